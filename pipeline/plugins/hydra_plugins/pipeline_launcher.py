"""The pipeline's Hydra sweeper and launcher (run on the driver). Hydra loads them only from the
``hydra_plugins`` namespace package, so pyproject.toml installs this directory as that package; the
bookkeeping is in :mod:`pipeline.sweep`. Both are selected in ``conf/config.yaml``."""

from __future__ import annotations

from hydra._internal.core_plugins.basic_launcher import BasicLauncher
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.utils import JobReturn
from hydra.errors import ConfigCompositionException
from omegaconf.errors import OmegaConfBaseException

from pipeline import sweep


class PipelineLauncher(BasicLauncher):
    """Hydra's basic launcher (jobs one after another in this process), except that a job whose
    overrides do not compose (``train.epochs=2,many``) becomes a FAILED child run and the sweep goes
    on, where Hydra's own stops the whole sweep."""

    def launch(self, job_overrides, initial_job_idx: int) -> list[JobReturn]:
        runs = []
        for offset, overrides in enumerate(job_overrides):
            try:
                runs += super().launch([overrides], initial_job_idx + offset)
            except (ConfigCompositionException, OmegaConfBaseException) as err:
                runs.append(sweep.record_uncomposable(self.config, list(overrides), initial_job_idx + offset, err))
        return runs


class PipelineSweeper(BasicSweeper):
    """Hydra's basic sweeper (grids from comma lists and ranges), except that it does not compose every
    job of a batch before launching any, which stops the sweep at the first job that does not
    compose: :class:`PipelineLauncher` records such jobs one by one."""

    def validate_batch_is_legal(self, batch) -> None:
        pass
