"""The pipeline's Hydra sweepers and launcher (run on the driver). Hydra loads them only from the
``hydra_plugins`` namespace package, so pyproject.toml installs this directory as that package; the
bookkeeping is in :mod:`pipeline.jobs.sweep`, the Ray Tune sweep in :mod:`pipeline.jobs.tune`. The basic
ones are selected in ``conf/config.yaml``, the Tune one by ``hparams_search=tune``; so is the callback that
closes a sweep."""

from __future__ import annotations

import logging
import sys

from hydra.core.utils import JobReturn, configure_log
from hydra.errors import ConfigCompositionException
from hydra.experimental.callback import Callback
from hydra.plugins.launcher import Launcher
from hydra.plugins.sweeper import Sweeper
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from pipeline.common.workarounds import hydra_basic_plugins

BasicLauncher, BasicSweeper = hydra_basic_plugins()


class PipelineLauncher(BasicLauncher):
    """Hydra's basic launcher (jobs one after another in this process), except that a job whose
    overrides do not compose (``train.epochs=2,many``) becomes a FAILED child run and the sweep goes
    on, where Hydra's own stops the whole sweep."""

    def launch(self, job_overrides, initial_job_idx: int) -> list[JobReturn]:
        # MLflow's and torch's imports only once a sweep launches: Hydra imports this module for every
        # command, before it composes the config, and a mistyped override should fail at once
        from pipeline.jobs import sweep

        runs = []
        for offset, overrides in enumerate(job_overrides):
            try:
                runs += super().launch([overrides], initial_job_idx + offset)
            except (ConfigCompositionException, OmegaConfBaseException) as err:
                runs.append(sweep.record_uncomposable(self.config, list(overrides), initial_job_idx + offset, err))
        return runs


class RayJobsLauncher(Launcher):
    """``hydra/launcher=ray_jobs``: each job a Ray job on the cluster at ``RAY_ADDRESS``
    (:mod:`pipeline.jobs.ray_jobs`); its settings are ``hydra.launcher.*`` (conf/hydra/launcher/ray_jobs.yaml)."""

    def __init__(self, **settings) -> None:
        self.settings = settings

    def setup(self, *, hydra_context, task_function, config: DictConfig) -> None:
        self.hydra_context, self.config = hydra_context, config

    def launch(self, job_overrides, initial_job_idx: int) -> list[JobReturn]:
        from pipeline.common import signals
        from pipeline.common.errors import PipelineError
        from pipeline.jobs import ray_jobs  # Ray's and MLflow's imports, only when a sweep launches

        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        signals.install()  # Ctrl-C and SIGTERM stop the submitted jobs first
        settings = ray_jobs.Settings(**self.settings)
        try:
            return ray_jobs.launch(
                self.config, self.hydra_context.config_loader, job_overrides, initial_job_idx, settings
            )
        except PipelineError as err:
            logging.getLogger("pipeline").error("%s", err)
            sys.exit(1)
        except KeyboardInterrupt:
            sys.exit(130)


class PipelineSweeper(BasicSweeper):
    """Hydra's basic sweeper (grids from comma lists and ranges), except that it does not compose every
    job of a batch before launching any, which stops the sweep at the first job that does not
    compose: :class:`PipelineLauncher` records such jobs one by one."""

    def validate_batch_is_legal(self, batch) -> None:
        """Skipped: each job is composed as it launches (the batch's check would compose them all first)."""


class TuneSweeper(Sweeper):
    """A sweep on Ray Tune (concurrent trials, early stopping, search algorithms, resumable): see
    :mod:`pipeline.jobs.tune`. Its settings are ``hydra.sweeper.*`` (conf/hparams_search/tune.yaml)."""

    def __init__(self, **settings) -> None:
        self.settings = OmegaConf.create(settings)

    def setup(self, *, hydra_context, task_function, config: DictConfig) -> None:
        self.loader, self.config = hydra_context.config_loader, config

    def sweep(self, arguments: list[str]) -> None:
        from pipeline.common.errors import PipelineError
        from pipeline.jobs import tune  # Ray Tune's imports, only when this sweeper runs

        try:
            tune.sweep(self.config, self.loader, arguments, self.settings)
        except PipelineError as err:
            logging.getLogger("pipeline").error("%s", err)
            sys.exit(1)


class SweepSummary(Callback):
    """Registered in ``conf/config.yaml`` under ``hydra.callbacks``: at a ``-m`` sweep's end, the best child on
    the parent run and a table of jobs (:func:`pipeline.jobs.sweep.summarize_sweep`). Hydra builds callbacks for every
    command before it composes the config: MLflow's imports wait for a sweep's end."""

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        from pipeline.jobs import sweep

        sweep.summarize_sweep(config)
