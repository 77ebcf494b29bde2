"""Tracking stage (runs on the driver): what a job's MLflow run holds, written only from the driver.

:class:`Tracker` owns a training job's run from start (or reopening, to resume) to its end state: the
config, the data, each epoch's metrics once, restores, the learning curve. The store and the runs' life
are :mod:`pipeline.tracking.mlflow_store`'s; the checkpoints' LoggedModels and the registry :mod:`pipeline.tracking.models`'.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import tempfile
import time
from collections.abc import Callable

import yaml
from mlflow import MlflowClient
from mlflow.entities import Param

from pipeline.common.console import data_wait_note
from pipeline.common.errors import PipelineError, redact
from pipeline.common.metrics import epoch_metrics, first_task_metric
from pipeline.config import PipelineConfig, logged
from pipeline.runtime.filesystems import RunStorage
from pipeline.tracking.delivery import Delivery, metrics_record
from pipeline.tracking.lineage import dataset_name, log_data
from pipeline.tracking.mlflow_store import (
    MAX_TAG_LENGTH,
    STORAGE_TAG,
    Store,
    end_run,
    end_status,
    error_text,
    reopen,
    reopen_run,
    start_run,
)
from pipeline.tracking.models import BEST_MODEL_TAG
from pipeline.tracking.spool import SPOOL_FILE, Spool, sent_marker
from pipeline.training import checkpoint

log = logging.getLogger(__name__)

MAX_PARAMS_PER_BATCH = 100  # MLflow's limit for one log_batch call
STOPPED_TAG = "pipeline.stopped_early"  # a run that train.early_stop or a Tune scheduler stopped: when, and why
NO_LEARNING_TAG = "pipeline.no_learning"  # the last validation no better than a constant prediction, and by how much
RESTORES_METRIC = "restores"  # count of restores from a checkpoint; step = the epoch training continued at
STEP_LOSS_METRIC = "train_loss_step"  # rank 0's batch loss every tracking.log_every_n_steps; step = global step
DATA_WAIT_TAG = "pipeline.data_wait"  # the latest epoch whose training waited for data, and what to raise
START_WEIGHTS_TAG = "pipeline.start_weights"  # finetune.weights: where training started, what started fresh
CACHE_TAG = "pipeline.cache"  # what ingest.cache kept in the object store (or why it streamed)
END_WAIT_S = 10.0  # how long a run that failed or was stopped waits for the tracking server: within Ray's stop grace


def flatten(node: object, prefix: str = "") -> dict[str, str]:
    """``{"model": {"hidden_dim": 384}}`` -> ``{"model.hidden_dim": "384"}``; lists stay whole values."""
    if not isinstance(node, dict):
        return {prefix: str(node)}
    flat: dict[str, str] = {}
    for key, value in node.items():
        flat.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def without_secrets(cfg: PipelineConfig) -> dict:
    """``cfg`` as plain data, with the values of ``ray.runtime_env.env_vars`` (where credentials for the
    cluster's workers go) replaced by ``***``."""
    plain, env_vars = dataclasses.asdict(cfg), cfg.ray.runtime_env.get("env_vars")
    if env_vars:
        plain["ray"]["runtime_env"]["env_vars"] = dict.fromkeys(env_vars, "***")
    return plain


def log_config(client: MlflowClient, run_id: str, cfg: PipelineConfig) -> None:
    """The resolved config, secrets removed, twice: flattened as params (searchable) and whole as
    ``config.yaml`` (what :func:`logged_config` reads back)."""
    cfg = without_secrets(cfg)
    params = [Param(key, redact(value)) for key, value in flatten(cfg).items()]
    for start in range(0, len(params), MAX_PARAMS_PER_BATCH):
        client.log_batch(run_id, params=params[start : start + MAX_PARAMS_PER_BATCH])
    client.log_text(run_id, redact(yaml.safe_dump(cfg, sort_keys=False)), "config.yaml")


def logged_config(client: MlflowClient, run_id: str) -> PipelineConfig:
    """The config a run logged (``config.yaml``), typed."""
    with tempfile.TemporaryDirectory() as tmp, open(client.download_artifacts(run_id, "config.yaml", tmp)) as file:
        return logged(yaml.safe_load(file), f"run {run_id}")


def logged_epochs(client: MlflowClient, run_id: str) -> set[int]:
    """Epochs whose metrics the run already holds (a resumed run continues after them)."""
    return {m.step for m in client.get_metric_history(run_id, "train_loss")}


class Tracker:
    """A training job's MLflow run: created (or, with ``train.resume``, reopened) when training is about
    to start, each epoch logged exactly once, restores counted, the learning curve drawn and the end
    state set when the ``with`` block ends: FINISHED, KILLED on Ctrl-C or SIGTERM, FAILED otherwise.

    Each write is a record (:mod:`pipeline.tracking.delivery`) written at once, or, once :meth:`spool_to` is called,
    kept on disk and sent by the spool's thread (:mod:`pipeline.tracking.spool`), so training never waits on the server."""

    def __init__(self, store: Store, run_id: str, resume_from: str | None, started_at: float, cfg: PipelineConfig):
        self.client, self.uri, self.run_id, self.experiment_id = store.client, store.uri, run_id, store.experiment_id
        self.cfg, task = cfg, cfg.task
        self.metrics = list(epoch_metrics(task.type, task.metrics))  # what each epoch reports
        self.settings = cfg.tracking
        self.resume_from = resume_from  # where a resumed run's checkpoints are
        self.started_at = started_at  # startup_s counts from here
        self.name = store.client.get_run(run_id).info.run_name  # for the messages given while the server is away
        self.logged = logged_epochs(store.client, run_id)  # a resumed run holds its first epochs already
        self.restores = len(store.client.get_metric_history(run_id, RESTORES_METRIC))
        self.rerun: set[int] = set()  # logged epochs that training runs again, restored from an older checkpoint
        self.last: dict | None = None  # the latest epoch's metrics
        self.stopped_early: str | None = None  # why train.early_stop ended training, when it did
        self.expected_rows: Callable[[int], dict[str, int]] = lambda workers: {}  # by metric, on that many workers
        self.storage: RunStorage | None = None  # where Ray Train keeps the run's checkpoints
        self.dataset_of: dict[str, tuple[str, str]] = {}  # metric -> the dataset (name, digest) it was measured on
        self.delivery = Delivery(self.client, self.experiment_id, run_id, cfg, first_task_metric(task.metrics))
        self.spool: Spool | None = None
        self._startup_logged = False
        self._system_metrics = None  # MLflow's SystemMetricsMonitor while the ``with`` block runs

    # The tracker factory: every run the pipeline writes is created or reopened by one of these three.

    @classmethod
    def open(cls, cfg: PipelineConfig, job) -> Tracker:
        """A training job's run (``job``: a :class:`pipeline.jobs.build.Job`): the one ``train.resume``
        continues, or a new one (in a sweep, nested under the sweep's parent run)."""
        store = Store.open(cfg.tracking, cfg.paths.outputs, job.experiment)
        if cfg.train.resume:
            run_id, resume_from = reopen_run(store, cfg.tracking.run_name)
            return cls(store, run_id, resume_from, job.started_at, cfg)
        parent = store.sweep_parent(job.sweep_dir) if job.sweep_dir else None
        return cls.start(store, cfg, job, cfg.tracking.run_name or job.run_name, parent)

    @classmethod
    def start(
        cls, store: Store, cfg: PipelineConfig, job, run_name: str | None, parent: str | None, tags: dict | None = None
    ) -> Tracker:
        """A new run in ``store``, nested under ``parent``, tagged with ``job``'s overrides and ``tags``,
        with the config logged."""
        run_id = start_run(store, run_name, parent, job.overrides, tags)
        log_config(store.client, run_id, cfg)
        return cls(store, run_id, None, job.started_at, cfg)

    @classmethod
    def reopen_tagged(cls, store: Store, cfg: PipelineConfig, tag: str, value: str) -> Tracker | None:
        """The run tagged ``tag=value`` (a Tune trial a resumed sweep restarts), RUNNING again; None if none."""
        found = store.runs_where(tag, value)
        return cls(store, reopen(store.client, found[0]), None, time.time(), cfg) if found else None

    def spool_to(self, directory: str) -> None:
        """From now on every write is kept in ``directory``'s spool and sent from there."""
        header = {"run_id": self.run_id, "experiment_id": self.experiment_id, "tracking_uri": redact(self.uri)}
        remote = self.uri.startswith(("http://", "https://"))
        self.spool = Spool(os.path.join(directory, SPOOL_FILE), header, self.delivery, remote)

    def write(self, record: dict) -> None:
        if self.spool is None:
            self.delivery(record)
        else:
            self.spool.add(record)

    def tag(self, key: str, value: str) -> None:
        self.write({"kind": "tags", "tags": {key: value[:MAX_TAG_LENGTH]}})

    def set_storage(self, storage: RunStorage) -> None:
        """Where Ray Train keeps this run's checkpoints (what ``train.resume`` continues from)."""
        self.storage = storage
        self.tag(STORAGE_TAG, storage.uri)

    def log_startup(self, first_step_at: float, epoch: int) -> None:
        """``startup_s``: from the command (a sweep's later jobs: their own start) to the first training step."""
        if not self._startup_logged:
            self.write(metrics_record({"startup_s": first_step_at - self.started_at}, epoch))
            self._startup_logged = True

    def log_epoch(self, metrics: dict, checkpoint: str | None = None) -> None:
        """An epoch's metrics, once (step = epoch), and ``skipped_rows`` when rows went missing; with
        ``tracking.log_model``, its checkpoint (a path in the run's storage) as a LoggedModel they link to."""
        epoch = metrics["epoch"]
        if epoch in self.rerun:  # its record came from its own checkpoint (reconcile), which Ray did not restore
            self.rerun.discard(epoch)
            self.last = metrics
            log.info("epoch %d ran again from an older checkpoint; its first record stands in MLflow", epoch + 1)
            return
        if epoch in self.logged:
            raise PipelineError(f"epoch {epoch} was reported twice; its first metrics stand in MLflow.")
        self.logged.add(epoch)
        model = (
            {"epoch": epoch, "checkpoint": checkpoint} if checkpoint is not None and self.settings.log_model else None
        )
        self.write(metrics_record({k: metrics[k] for k in self.metrics}, epoch, model, self.dataset_of))
        note = data_wait_note(metrics["data_wait_fraction"], self.settings.data_wait_warning)
        if note is not None:
            self.tag(DATA_WAIT_TAG, f"epoch {epoch + 1}: {note}")
        if "stopped_early" in metrics:  # train.early_stop ended training after this epoch
            self.stopped_early = f"after epoch {epoch + 1} by train.early_stop: {metrics['stopped_early']}"
            self.tag(STOPPED_TAG, self.stopped_early)
        expected = self.expected_rows(int(metrics["workers"]))  # elastic: the epoch's worker group's size
        skipped = sum(max(0, rows - int(metrics[key])) for key, rows in expected.items())
        if skipped:
            self.write(metrics_record({"skipped_rows": skipped}, epoch))
            log.warning(
                "epoch %d: %d row(s) never reached training (skipped by a transform; Ray's worker logs name them)",
                epoch + 1,
                skipped,
            )
        self.last = metrics

    def reconcile(self) -> None:
        """Log each epoch whose checkpoint Ray Train persisted but whose report never reached the driver (a
        signal or a crash between the two): every checkpoint's epoch is in MLflow, once, resumed or not."""
        if self.storage is None:
            return
        for path, metrics in checkpoint.reports(self.storage.filesystem, f"{self.storage.path}/{self.storage.name}"):
            finite = all(math.isfinite(v) for v in metrics.values() if isinstance(v, float))
            if metrics["epoch"] not in self.logged and finite:  # NaN failed the run before it reached MLflow
                log.warning(
                    "epoch %d: logged from its checkpoint's report; it never reached the driver", metrics["epoch"] + 1
                )
                self.log_epoch(metrics, path)

    def log_step_loss(self, loss: float, global_step: int) -> None:
        """A training batch's loss between epochs, so the UI's chart has a point per N steps."""
        self.write(metrics_record({STEP_LOSS_METRIC: loss}, global_step))

    def flag_no_learning(self, verdict: str) -> None:
        """Mark a run whose model scores no better than a constant prediction (:func:`pipeline.training.task.no_learning`)."""
        self.tag(NO_LEARNING_TAG, verdict)

    def log_restore(self, epoch: int) -> None:
        """Count a restore from a checkpoint (a restarted worker group or a resumed run) at ``epoch``."""
        self.rerun = {logged for logged in self.logged if logged >= epoch}
        self.restores += 1
        self.write(metrics_record({RESTORES_METRIC: self.restores}, epoch))

    def log_data(self, splits: dict, statistics: dict | None) -> None:
        """What the run trains and validates on (a resumed run logged it on its first start)."""
        measured_on = {"train": splits["train"], "val": splits["valid"]}  # train_loss, val_accuracy, ...
        for key in self.metrics:
            if (split := measured_on.get(key.split("_", 1)[0])) is not None:
                self.dataset_of[key] = (dataset_name(split), split.digest)
        if self.resume_from is None:
            log_data(self.client, self.run_id, splits, statistics)

    def log_start_weights(self, initial) -> None:
        """Where the weights came from, and which of the head's started fresh (a :class:`pipeline.training.finetune.Initial`)."""
        self.tag(START_WEIGHTS_TAG, redact(initial.summary()))

    def log_cache(self, plan) -> None:
        """What ``ingest.cache`` kept (a :class:`pipeline.data.preprocess.CachePlan`): the ``pipeline.data.cache`` tag,
        and per cached split ``cache_<split>_mib`` and ``cache_<split>_s`` (from submission to built)."""
        self.tag(CACHE_TAG, plan.summary())
        for name, built in plan.built.items():
            self.write(
                metrics_record({f"cache_{name}_mib": built["bytes"] / 2**20, f"cache_{name}_s": built["seconds"]}, 0)
            )

    def finish_models(
        self, keep: set[str] | None, metric: str | None, mode: str, register_as: str | None, alias: str | None
    ) -> None:
        """Training ended: the kept checkpoints' LoggedModels get their files, the best is the run's model
        (:meth:`pipeline.tracking.models.CheckpointModels.finish`)."""
        kept = None if keep is None else sorted(keep)
        self.write(
            {
                "kind": "models",
                "keep": kept,
                "storage": self.storage.uri,
                "metric": metric,
                "mode": mode,
                "register_as": register_as,
                "alias": alias,
            }
        )

    def model_uri(self) -> str | None:
        """The run's best LoggedModel as a ``models:/`` URI, once the run has ended; None without one."""
        model_id = self.client.get_run(self.run_id).data.tags.get(BEST_MODEL_TAG)
        return None if model_id is None else f"models:/{model_id}"

    def end(self, status: str, error: BaseException | None = None) -> None:
        """The learning curve, if any epoch was logged, then the end state; with a spool, once the server has
        the whole record, for ``tracking.server_wait_s`` at most (a few seconds for a run that did not finish)."""
        self.write({"kind": "end", "status": status, "error": None if error is None else error_text(error)})
        if self.spool is None:
            return
        wait = self.settings.server_wait_s if status == "FINISHED" else min(self.settings.server_wait_s, END_WAIT_S)
        try:
            if self.spool.flush(wait):
                return
        except Exception as refused:  # delivery stopped at a record the store refused: end the run as it is
            self.end_refused(status, error, refused)
            return
        kept = self.keep_spool()
        message = (
            f"the MLflow tracking server at {redact(self.uri)} did not take run {self.name!r} ({self.run_id}) "
            f"within {wait:.0f} s of its end (tracking.server_wait_s), so MLflow holds only part of it. The whole "
            f"record is kept in {self.spool.path}{f' and {kept}' if kept else ''}. Once the server answers, upload "
            f"it into the same run with: python -m pipeline.sync {self.spool.path}"
        )
        if status != "FINISHED":  # the run's own error stays the one raised
            log.error("%s", message)
            return
        raise PipelineError(message)

    def end_refused(self, status: str, error: BaseException | None, refused: Exception) -> None:
        """The store refused one of the run's records, so the rest, its end included, were not sent: the run is
        ended here, FAILED with the refusal if it had finished. A run that failed or was stopped ends with its
        own error, which stays the one raised; the refusal is said beside it."""
        if status == "FINISHED":
            end_run(self.client, self.run_id, "FAILED", error_text(refused))
            raise refused
        log.error("the MLflow store refused a record of run %r (%s): %s", self.name, self.run_id, error_text(refused))
        try:
            end_run(self.client, self.run_id, status, None if error is None else error_text(error))
        except Exception as again:  # the store is broken: the run's own error is still the one to raise
            log.error("run %r (%s) could not be ended as %s: %s", self.name, self.run_id, status, again)

    def keep_spool(self) -> str | None:
        """The spool copied beside the run's checkpoints (a job's output directory may not outlive it); where."""
        if self.storage is None:
            return None
        target = f"{self.storage.path}/{self.storage.name}/{SPOOL_FILE}"
        for source, name in ((self.spool.path, target), (sent_marker(self.spool.path), sent_marker(target))):
            if os.path.exists(source):
                with open(source, "rb") as file, self.storage.filesystem.open_output_stream(name) as out:
                    out.write(file.read())
        return f"{self.storage.uri}/{SPOOL_FILE}"

    def __enter__(self) -> Tracker:
        """Start MLflow's system metrics (this node's CPU, memory, disk, network, and GPU when pynvml
        finds one) for the run, under ``system/``; a resumed run continues their steps."""
        interval = self.settings.system_metrics_s
        if interval:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            self._system_metrics = SystemMetricsMonitor(
                self.run_id, interval, resume_logging=self.resume_from is not None, tracking_uri=self.uri
            )
            self._system_metrics.start()
        return self

    def __exit__(self, kind, error, traceback) -> None:
        self.close(error)

    def close(self, error: BaseException | None) -> None:
        """The system metrics stopped, the epochs the checkpoints hold logged, the run ended as ``error`` says."""
        away = self.spool is not None and self.spool.away_since is not None
        if self._system_metrics is not None and not away:  # its last samples are not worth MLflow's retries
            self._system_metrics.finish()  # flushed before the run ends: an ended run takes no metrics
        try:
            self.reconcile()
        finally:
            self.end(end_status(error), error)
