"""Runs in a Ray Tune trial actor (one per trial, on any node of the cluster): the pipeline's training
job for one sampled point of a ``hparams_search=tune`` sweep, reported to Tune.

The trial writes nothing to MLflow: Ray Train's ``TuneReportCallback`` hands each epoch's report to
Tune, and the sweep's driver (``tuning.py``) records it. A trial's checkpoints live under its Tune
trial id, so a trial that Tune restarts (a resumed sweep) continues from its latest one.
"""

from __future__ import annotations

import copy
import os

from omegaconf import DictConfig, OmegaConf
from ray import tune
from ray.tune.integration.ray_train import TuneReportCallback

from pipeline.config import PipelineConfig, load
from pipeline.data import preprocess
from pipeline.jobs import build
from pipeline.runtime import filesystems
from pipeline.training import events, relay, trainer

GROUP_KEY = "__groups__"  # a trial's config-group choices: which composed base config it starts from


def trial_config(bases: dict[str, DictConfig], params: dict) -> PipelineConfig:
    """The typed config of a trial: the base composed for its group choices, with its sampled values set as
    Hydra would set ``key=value`` (typed by the schema, so a wrong type fails here)."""
    cfg = copy.deepcopy(bases[params.get(GROUP_KEY, "")])
    for key, value in params.items():
        if key != GROUP_KEY:
            OmegaConf.update(cfg, key, value, merge=False)
    return load(cfg)


def trial_dir(sweep_dir: str, trial_id: str) -> str:
    """A trial's output directory: its checkpoints (with storage.path unset) and the driver's records."""
    return os.path.join(sweep_dir, trial_id)


def run_trial(params: dict, bases: dict[str, DictConfig], sweep_dir: str) -> None:
    """Tune's trainable: the trial's job built as a run builds its own (:mod:`pipeline.jobs.build`), then trained."""
    cfg = trial_config(bases, params)
    with preprocess.training_data(cfg, build.sources(cfg)) as data:
        trial_id = tune.get_context().get_trial_id()
        storage = filesystems.run_storage(cfg.storage, trial_dir(sweep_dir, trial_id), trial_id)
        initial = build.start_weights(cfg)  # read where the trial runs: any node of the cluster
        trainer.fit(cfg, data, storage, TrialEvents(), initial, callbacks=(TuneReportCallback(),))


class TrialEvents:
    """The workers' events in a trial: each report's ranks checked to agree (a disagreement fails the
    trial); progress, restores and placement reach the driver in the reports themselves."""

    def epoch_reported(self, event: events.EpochReported) -> None:
        relay.checked_ranks(event)

    def step_taken(self, event: events.StepTaken) -> None:
        pass

    def worker_started(self, event: events.WorkerStarted) -> None:
        pass

    def checkpoint_restored(self, event: events.CheckpointRestored) -> None:
        pass

    def close(self) -> None:
        pass
