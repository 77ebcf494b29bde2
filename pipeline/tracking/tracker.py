"""A training job's MLflow run, on the driver: created, or reopened to resume, when training is about to
start, and ended once. Its parts: how writes reach MLflow and the run ends (:mod:`pipeline.tracking.record`),
each epoch once (:mod:`pipeline.tracking.epochs`), the config (:mod:`pipeline.tracking.run_config`); here,
what the run holds beside its epochs (data, start weights, cache, the models) and its life as a ``with``
block. The store is :mod:`pipeline.tracking.mlflow_store`'s; LoggedModels :mod:`pipeline.tracking.models`'.
"""

from __future__ import annotations

import logging

from pipeline.common.errors import redact
from pipeline.common.metrics import epoch_metrics, first_task_metric
from pipeline.common.workarounds import system_metrics_monitor
from pipeline.config import PipelineConfig
from pipeline.runtime.filesystems import RunStorage
from pipeline.tracking.delivery import Delivery, metrics_record
from pipeline.tracking.epochs import EpochLog
from pipeline.tracking.heartbeat import Heartbeat
from pipeline.tracking.lineage import dataset_name, log_data
from pipeline.tracking.liveness import DRIVER_TAG, this_driver
from pipeline.tracking.mlflow_store import (
    STORAGE_TAG,
    Store,
    end_orphans,
    end_status,
    reopen,
    reopen_run,
    start_run,
)
from pipeline.tracking.models import BEST_MODEL_TAG
from pipeline.tracking.record import RunRecord
from pipeline.tracking.run_config import log_config
from pipeline.training.checkpoint import checkpoint_mode

NO_LEARNING_TAG = "pipeline.no_learning"  # the last validation no better than a constant prediction, and by how much
START_WEIGHTS_TAG = "pipeline.start_weights"  # finetune.weights: where training started, what started fresh
CACHE_TAG = "pipeline.cache"  # what ingest.cache kept in the object store (or why it streamed)
SHUFFLE_TAG = "pipeline.shuffle"  # how the training split's windows mix it (the footers' label ranges)
READS_TAG = "pipeline.reads"  # what the streamed splits read, on which nodes
DEVICE_TAG = "pipeline.device_steps"  # the steps the training workers run on their device, per split

log = logging.getLogger(__name__)


class Tracker:
    """A training job's MLflow run, from its start (or reopening) to its end state, set when the ``with``
    block ends: FINISHED, KILLED on Ctrl-C or SIGTERM (recorded first), FAILED otherwise."""

    def __init__(self, store: Store, run_id: str, resume_from: str | None, cfg: PipelineConfig):
        task = cfg.task
        self.cfg, self.run_id, self.uri = cfg, run_id, store.uri
        self.resume_from = resume_from  # where a resumed run's checkpoints are
        delivery = Delivery(store.client, store.experiment_id, run_id, cfg, first_task_metric(task.metrics))
        self.record = RunRecord(store, run_id, delivery, cfg.tracking.server_wait_s)
        metrics = list(epoch_metrics(task.type, task.metrics, cfg.train.other_weights()))
        self.epochs = EpochLog(self.record, metrics, cfg.tracking)
        self.name = self.record.name
        self._system_metrics = None  # MLflow's SystemMetricsMonitor while the ``with`` block runs
        self._heartbeat: Heartbeat | None = None  # the driver's beat on a tracking server, while it runs

    # The tracker factory: every run the pipeline writes is created or reopened by one of these three.

    @classmethod
    def open(cls, cfg: PipelineConfig, job) -> Tracker:
        """A training job's run (``job``: a :class:`pipeline.jobs.job.Job`): the one ``train.resume``
        continues, or a new one (in a sweep, nested under the sweep's parent run). Runs a driver of this host left
        RUNNING when it died are ended first (:func:`end_orphans`): the one resumed among them, too."""
        store = Store.open(cfg.tracking, cfg.paths.outputs, job.experiment)
        end_orphans(store.client)
        if cfg.train.resume:
            run_id, resume_from = reopen_run(store, cfg.tracking.run_name)
            return cls(store, run_id, resume_from, cfg)
        parent = store.sweep_parent(job.sweep_dir) if job.sweep_dir else None
        return cls.start(store, cfg, job, cfg.tracking.run_name or job.run_name, parent, {DRIVER_TAG: this_driver()})

    @classmethod
    def start(
        cls, store: Store, cfg: PipelineConfig, job, run_name: str | None, parent: str | None, tags: dict | None = None
    ) -> Tracker:
        """A new run in ``store``, nested under ``parent``, tagged with ``job``'s overrides and ``tags``,
        with the config logged."""
        run_id = start_run(store, run_name, parent, job.overrides, tags)
        log_config(store.client, run_id, cfg)
        return cls(store, run_id, None, cfg)

    @classmethod
    def reopen_tagged(cls, store: Store, cfg: PipelineConfig, tag: str, value: str) -> Tracker | None:
        """The run tagged ``tag=value`` (a Tune trial a resumed sweep restarts), RUNNING again; None if none."""
        found = store.runs_where(tag, value)
        return cls(store, reopen(store.client, found[0]), None, cfg) if found else None

    @property
    def storage(self) -> RunStorage | None:
        return self.record.storage

    def set_storage(self, storage: RunStorage) -> None:
        """Where Ray Train keeps this run's checkpoints (what ``train.resume`` continues from)."""
        self.record.storage = storage
        self.record.tag(STORAGE_TAG, storage.uri)

    def log_data(self, splits: dict, statistics: dict | None) -> None:
        """What the run trains and validates on (a resumed run logged it on its first start)."""
        measured_on = {"train": splits["train"], "val": splits["valid"]}  # train_loss, val_accuracy, ...
        for key in self.epochs.metrics:
            if (split := measured_on.get(key.split("_", 1)[0])) is not None:
                self.epochs.dataset_of[key] = (dataset_name(split), split.digest)
        if self.resume_from is None:
            log_data(self.record.client, self.run_id, splits, statistics)

    def log_start_weights(self, initial) -> None:
        """Where the weights came from, and which of the head's started fresh (a ``finetune.Initial``)."""
        self.record.tag(START_WEIGHTS_TAG, redact(initial.summary()))

    def log_cache(self, summary: str, built: dict[str, dict]) -> None:
        """What ``ingest.cache`` kept: the ``pipeline.cache`` tag, and per cached split ``cache_<split>_mib``
        and ``cache_<split>_s`` (from submission to built)."""
        self.record.tag(CACHE_TAG, summary)
        for name, figures in built.items():
            mib, seconds = figures["bytes"] / 2**20, figures["seconds"]
            self.record.write(metrics_record({f"cache_{name}_mib": mib, f"cache_{name}_s": seconds}, 0))

    def log_ingest(self, shuffle: str | None = None, reads: str | None = None, device: str | None = None) -> None:
        """How the training split's windows mix it (``pipeline.shuffle``), where the streamed splits were read
        (``pipeline.reads``) and which steps the workers run on their device (``pipeline.device_steps``), where
        known."""
        for tag, value in ((SHUFFLE_TAG, shuffle), (READS_TAG, reads), (DEVICE_TAG, device)):
            if value is not None:
                self.record.tag(tag, value)

    def flag_no_learning(self, verdict: str) -> None:
        """Mark a run whose model scores no better than a constant prediction (``task.no_learning``)."""
        self.record.tag(NO_LEARNING_TAG, verdict)

    def finish_models(self, keep: set[str] | None, alias: str | None) -> None:
        """Training ended: the kept checkpoints' LoggedModels get their files, the best (by
        ``train.checkpoint_metric``, or else the last) is the run's model and, with ``tracking.register_as``,
        registered (:meth:`pipeline.tracking.models.CheckpointModels.finish`)."""
        train, task = self.cfg.train, self.cfg.task
        self.record.write(
            {
                "kind": "models",
                "keep": None if keep is None else sorted(keep),
                "storage": self.storage.uri,
                "metric": train.checkpoint_metric,
                "mode": checkpoint_mode(train, task),
                "register_as": self.cfg.tracking.register_as,
                "alias": alias,
            }
        )

    def log_profile(self) -> None:
        """With ``train.profile``, after each epoch: what rank 0 wrote in the run's storage under ``profile/`` (the
        trace, the operators, Ray Data's stats so far) copied to the run's artifacts, overwriting the last copy."""
        if self.cfg.train.profile.enabled:
            self.record.write({"kind": "profile", "storage": self.storage.uri})

    def model_uri(self) -> str | None:
        """The run's best LoggedModel as a ``models:/`` URI, once the run has ended; None without one."""
        model_id = self.record.client.get_run(self.run_id).data.tags.get(BEST_MODEL_TAG)
        return None if model_id is None else f"models:/{model_id}"

    def end(self, status: str, error: BaseException | None = None) -> None:
        self.record.end(status, error)

    def stop_first(self, error: BaseException) -> None:
        """A stop (Ctrl-C, SIGTERM) recorded KILLED at once, the heartbeat stopped before it: nothing sets the run
        RUNNING again while the stop waits for its checkpoint, which ``ray job stop``'s SIGKILL may cut short."""
        if self._heartbeat is not None:
            self._heartbeat.stop()
        if not self.superseded:
            self.record.stop_first("KILLED", error)

    @property
    def superseded(self) -> bool:
        """Another driver took the run while this one was cut off from the server (:mod:`.heartbeat`)."""
        return self._heartbeat is not None and self._heartbeat.superseded

    def __enter__(self) -> Tracker:
        """Start MLflow's system metrics (this node's CPU, memory, disk, network, and GPU when pynvml
        finds one) for the run, under ``system/``; a resumed run continues their steps. On a tracking server, the
        driver's heartbeat."""
        if self.uri.startswith(("http://", "https://")):
            self._heartbeat = Heartbeat(self.record.client, self.uri, self.run_id)
        interval = self.cfg.tracking.system_metrics_s
        if interval:
            self._system_metrics = system_metrics_monitor(self.run_id, interval, self.resume_from is not None, self.uri)
        return self

    def __exit__(self, kind, error, traceback) -> None:
        self.close(error)

    def close(self, error: BaseException | None) -> None:
        """How a training run ends, in one place: the heartbeat stopped; a stop (Ctrl-C, SIGTERM) recorded first; the
        system metrics stopped; the epochs the checkpoints hold logged; the end state once the store has the rest."""
        status = end_status(error)
        if self._heartbeat is not None:
            self._heartbeat.stop()
        if self.superseded:  # the run's end is the other driver's; this one's record stays in its spool, if any
            log.error("run %s is held by another driver: this command's end (%s) is not recorded", self.run_id, status)
            return
        if status == "KILLED":
            self.stop_first(error)
        if self._system_metrics is not None and not self.record.server_away:  # no use retrying its last samples
            self._system_metrics.finish()  # its last samples, before the spool's end record
        try:
            self.epochs.reconcile(self.storage)
        finally:
            self.record.end(status, error)
