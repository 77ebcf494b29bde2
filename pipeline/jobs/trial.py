"""One trial of a ``hparams_search=tune`` sweep: the pipeline's training job for one sampled point.

Two halves, on two sides of Tune:
- :class:`TrialJob` runs in a Ray Tune trial actor (one per trial, on any node of the cluster): the training
  job of :mod:`pipeline.jobs.train`, with the steps where a trial differs overridden. It writes nothing to
  MLflow: Ray Train's ``TuneReportCallback`` hands each epoch's report to Tune.
- :class:`TrialRecorder` runs in the sweep's driver (Tune calls it there) and records each trial with the
  same :class:`pipeline.tracking.tracker.Tracker` a run uses.
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import ray.train
from omegaconf import DictConfig, OmegaConf
from ray import tune
from ray.tune.integration.ray_train import TuneReportCallback

from pipeline.common import console, workarounds
from pipeline.common.errors import PipelineError, root_cause
from pipeline.config import PipelineConfig, load
from pipeline.data import preprocess
from pipeline.jobs import preflight
from pipeline.jobs.job import Job, append_record, run_name
from pipeline.jobs.train import TrainingJob
from pipeline.runtime import filesystems
from pipeline.runtime.filesystems import RunStorage
from pipeline.tracking import mlflow_store
from pipeline.tracking.epochs import STOPPED_TAG
from pipeline.tracking.tracker import Tracker
from pipeline.training import trainer
from pipeline.training.events import STEP_KEY

log = logging.getLogger("pipeline")
GROUP_KEY = "__groups__"  # a trial's config-group choices: which composed base config it starts from
TRIAL_TAG = "pipeline.tune_trial_id"


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


def run_trial(params: dict, bases: dict[str, DictConfig], sweep_dir: str, experiment: str) -> None:
    """Tune's trainable, in a trial actor: the trial's training job (:class:`TrialJob`) for its sampled point."""
    TrialJob(trial_config(bases, params), sweep_dir, experiment).run()


class TrialJob(TrainingJob):
    """A training job in a Tune trial actor (on any node of the cluster). Where it differs from a run's:

    - check: the sweep's driver checked the config and Ray is up: the sources and start weights are read here;
    - record, finish, evaluate: not here; Tune hands each report to :class:`TrialRecorder` on the driver;
    - storage: under the trial's Tune id, so a trial Tune restarts (a resumed sweep) continues from its checkpoints;
    - fit: the reports go to Tune (``TuneReportCallback``), not to a recorder.
    """

    def __init__(self, cfg: PipelineConfig, sweep_dir: str, experiment: str):
        self.trial_id = tune.get_context().get_trial_id()
        super().__init__(cfg, Job(trial_dir(sweep_dir, self.trial_id), experiment))

    def check(self) -> None:
        self.splits, self.initial = preflight.sources(self.cfg), preflight.start_weights(self.cfg)

    @contextmanager
    def record(self, data: preprocess.TrainingData) -> Iterator[None]:
        yield

    def storage(self) -> RunStorage:
        return filesystems.run_storage(self.cfg.storage, self.job.run_dir, self.trial_id)

    def fit(self, data: preprocess.TrainingData, storage: RunStorage) -> ray.train.Result:
        return trainer.fit(self.cfg, data, storage, None, self.initial, callbacks=(EpochReports(),))

    def finish(self, data: preprocess.TrainingData, result: ray.train.Result) -> None:
        """Nothing here: :meth:`TrialRecorder.on_trial_complete` logs the trial's models on the driver."""

    def evaluate(self) -> None:
        """Nothing here: a sweep evaluates none of its trials."""


def error_text(trial) -> str:
    """A failed trial's traceback, from the file Tune writes beside its driver (or from storage)."""
    path = trial.error_file
    if path and os.path.exists(path):
        with open(path) as file:
            return file.read()
    return trial.get_error() or "the trial failed; Tune recorded no error."


def trial_overrides(params: dict) -> list[str]:
    """A trial's sampled values as Hydra overrides (``optim.lr=0.0012``)."""
    shown = []
    for key, value in params.items():
        shown.append(
            value if key == GROUP_KEY else f"{key}={value:.4g}" if isinstance(value, float) else f"{key}={value}"
        )
    return shown


@dataclass
class OpenTrial:
    """A running trial as the driver sees it: its MLflow run and typed config."""

    tracker: Tracker
    cfg: PipelineConfig


class EpochReports(TuneReportCallback):
    """Each epoch's report to Tune, not a checkpoint's within an epoch (``train.checkpoint_every``): Tune's
    schedulers compare epochs. A trial Tune restarts finds those checkpoints in its storage all the same."""

    def after_report(self, run_context, metrics: list[dict], checkpoint) -> None:
        if STEP_KEY not in metrics[0]:
            super().after_report(run_context, metrics, checkpoint)


class TrialRecorder(tune.Callback):
    """Runs in the sweep's driver (Tune calls it there): each trial's MLflow run, from its start to its
    end, nested under the sweep's parent run. A trial a scheduler stopped ends FINISHED, tagged
    ``pipeline.stopped_early``; a trial that failed ends FAILED with its error."""

    def __init__(self, bases: dict, splits: dict, sweep_dir: str, experiment: str, fixed: list[str], scheduler):
        self.bases, self.splits, self.sweep_dir, self.experiment = bases, splits, sweep_dir, experiment
        self.fixed, self.scheduler = fixed, scheduler
        self.open_trials: dict[str, OpenTrial] = {}
        self.groups: dict[str, str] = {}  # trial id -> its training placement group

    def __getstate__(self) -> dict:  # Tune saves its callbacks with the sweep's state: open runs stay here
        return {**self.__dict__, "open_trials": {}, "groups": {}}

    def on_trial_start(self, iteration: int, trials: list, trial, **info) -> None:
        trial_id, params = trial.trial_id, trial.config
        os.makedirs(trial_dir(self.sweep_dir, trial_id), exist_ok=True)  # its metrics.jsonl, wherever checkpoints go
        cfg = trial_config(self.bases, params)
        store = mlflow_store.Store.open(cfg.tracking, cfg.paths.outputs, self.experiment)
        tracker = self.reopen(store, cfg, trial_id) or self.open(store, cfg, trial_id, params)
        storage = filesystems.run_storage(cfg.storage, trial_dir(self.sweep_dir, trial_id), trial_id)
        tracker.set_storage(storage)
        self.open_trials[trial_id] = OpenTrial(tracker, cfg)
        log.info("trial %s started: %s", trial_id, " ".join(trial_overrides(params)))

    def open(self, store: mlflow_store.Store, cfg: PipelineConfig, trial_id: str, params: dict) -> Tracker:
        """A new child run, named for its number in the sweep and its sampled values."""
        overrides = [*self.fixed, *trial_overrides(params)]
        parent = store.sweep_parent(self.sweep_dir)
        name = run_name("trial", len(store.runs_where("mlflow.parentRunId", parent)), self.experiment, overrides)
        job = Job(
            trial_dir(self.sweep_dir, trial_id),
            self.experiment,
            overrides=overrides,
            sweep_dir=self.sweep_dir,
            run_name=name,
        )
        tracker = Tracker.start(store, cfg, job, name, parent, {TRIAL_TAG: trial_id})
        tracker.log_data(self.splits[params.get(GROUP_KEY, "")], None)
        return tracker

    def reopen(self, store: mlflow_store.Store, cfg: PipelineConfig, trial_id: str) -> Tracker | None:
        """The run of a trial that Tune restarts (a resumed sweep), RUNNING again; None for a new trial."""
        tracker = Tracker.reopen_tagged(store, cfg, TRIAL_TAG, trial_id)
        if tracker is not None:
            log.info("trial %s continues in MLflow run %s", trial_id, tracker.run_id)
        return tracker

    def on_trial_result(self, iteration: int, trials: list, trial, result: dict, **info) -> None:
        if result.get("epoch") is None:  # Tune's own final result of a trial
            return
        running = self.open_trials[trial.trial_id]
        tracker = running.tracker
        tracker.epochs.log_epoch(
            result, result.get("checkpoint_path")
        )  # TuneReportCallback's key for a report's checkpoint
        if result.get("placement_group"):
            self.groups[trial.trial_id] = result["placement_group"]
        if "node_id" in result:
            tracker.record.tag("pipeline.node_id", result["node_id"])
        report = {k: v for k, v in result.items() if k != "config"}
        append_record(trial_dir(self.sweep_dir, trial.trial_id), "metrics.jsonl", report)
        log.info(
            "trial %s: %s",
            trial.trial_id,
            console.format_metrics(
                result["epoch"], running.cfg.train.epochs, result, running.cfg.tracking.data_wait_warning
            ),
        )

    def on_trial_complete(self, iteration: int, trials: list, trial, **info) -> None:
        running = self.end_of(trial)
        if running is None:
            return
        tracker, epochs = running.tracker, running.cfg.train.epochs
        done = max(tracker.epochs.logged, default=-1) + 1
        if done == 0:
            tracker.end("FAILED", PipelineError("the trial ended without reporting an epoch."))
            return
        if done < epochs and tracker.epochs.stopped_early is None:  # stopped by the scheduler, not by itself
            note = f"after epoch {done} of {epochs}" + (f" by {self.scheduler}" if self.scheduler else "")
            tracker.record.tag(STOPPED_TAG, note)
            log.info("trial %s stopped early %s", trial.trial_id, note)
        tracker.finish_models(None, None)  # the alias: the sweep's best trial's, when it ends
        tracker.end("FINISHED")

    def on_trial_error(self, iteration: int, trials: list, trial, **info) -> None:
        running = self.end_of(trial)
        if running is not None:
            error = PipelineError(root_cause(RuntimeError(error_text(trial))))
            log.error("trial %s failed: %s", trial.trial_id, error)
            running.tracker.end("FAILED", error)

    def on_experiment_end(self, trials: list, **info) -> None:
        """Trials still open when the sweep stops (Ctrl-C): KILLED, to be continued by a resumed sweep."""
        for trial_id in list(self.open_trials):
            self.open_trials.pop(trial_id).tracker.end("KILLED")
            log.warning(
                "trial %s interrupted; continue the sweep with the same command plus: hydra.sweep.dir=%s",
                trial_id,
                self.sweep_dir,
            )

    def end_of(self, trial) -> OpenTrial | None:
        """The trial, no longer open, with its placement group released (see workarounds.py)."""
        group = self.groups.pop(trial.trial_id, None)
        if group is not None:
            workarounds.release_placement_group(group)
        return self.open_trials.pop(trial.trial_id, None)
