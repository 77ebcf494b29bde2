"""One training job, start to end, on the driver: checks -> datasets -> tracker -> fit -> model logged,
built as :mod:`pipeline.jobs.build` says (as a Tune trial builds its own).

Every check that can fail on the user's input runs before the job's MLflow run is created (those
that need Ray, once it is up). A single run that fails them leaves nothing in MLflow; a sweep's job
records them as a FAILED child run, so the sweep shows every job it tried.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, replace

from ray.exceptions import RayError

from pipeline.common import console, workarounds
from pipeline.common.errors import PipelineError, redact
from pipeline.config import PipelineConfig
from pipeline.data import preprocess, source
from pipeline.jobs import predict, preflight
from pipeline.jobs.build import Job, JobResult, append_record
from pipeline.runtime import filesystems, lifeline
from pipeline.tracking import mlflow_store
from pipeline.tracking.tracker import Tracker
from pipeline.training import task, trainer
from pipeline.training.events import CheckpointRestored, EpochReported, StepTaken, WorkerStarted

log = logging.getLogger(__name__)


def run(cfg: PipelineConfig, job: Job) -> JobResult:
    """Run one experiment from its typed config; returns its run, last epoch's metrics and best model."""
    job.run_dir = os.path.abspath(job.run_dir)
    console.quiet_libraries()
    kind, names = cfg.task.type, cfg.task.metrics
    try:
        splits, initial = preflight.checked(cfg)
        baseline = task.constant_baseline(kind, names, source.labels(splits["valid"]))  # what learning must beat
        plan = preprocess.cache_plan(cfg, splits)
        # with ingest.standardize, a pass over the training split: a value it cannot use fails here
        data = preprocess.training_data(cfg, splits, plan)
        if data.mixing is not None and (warning := data.mixing.warning()):
            log.warning("%s", warning)  # before training: a split its windows cannot mix
    except PipelineError as err:
        if job.sweep_dir:  # a sweep keeps a record of every job it tried
            Tracker.open(cfg, job).end("FAILED", err)
        raise
    with data:
        os.makedirs(job.run_dir, exist_ok=True)
        tracker = Tracker.open(cfg, job)
        log.info("MLflow run %s in %s; outputs in %s", tracker.run_id, redact(tracker.uri), job.run_dir)
        with tracker, resume_hint(tracker):  # the run ends FINISHED, or FAILED / KILLED with the error
            tracker.log_data(splits, data.statistics)
            tracker.log_ingest(shuffle=data.mixing.summary() if data.mixing else None)
            if initial is not None:
                log.info("finetune: %s", initial.summary())
                tracker.log_start_weights(initial)
            reporter = report_cache(data, tracker)
            tracker.epochs.expect_rows(data.rows, cfg.ingest.drop_last)
            storage = filesystems.run_storage(cfg.storage, job.run_dir, tracker.run_id, tracker.resume_from)
            tracker.set_storage(storage)
            tracker.record.spool_to(job.run_dir)  # from here on, training never waits on the tracking server
            tracker.epochs.reconcile(storage)  # a resumed run: the epoch an interrupted attempt saved but did not log
            steps, wait_limit = trainer.epoch_steps(cfg, data), cfg.tracking.data_wait_warning
            progress = console.Progress(cfg.train.epochs, steps, wait_limit)
            with lifeline.watched(lambda what: ray_lost(tracker, what)), progress:
                result = trainer.fit(cfg, data, storage, JobEvents(tracker, job.run_dir, progress), initial)
            reporter.join()  # training read every row, so the cache is built: its figures land before the run ends
            reads = data.reads()
            if reads is not None:
                log.info("ingest: %s", reads)
            tracker.log_ingest(reads=reads)
            if tracker.epochs.last is None:
                raise PipelineError("training finished without reporting an epoch.")
            alias = None if job.sweep_dir else cfg.tracking.register_alias  # a sweep's: its best job's
            tracker.finish_models(workarounds.kept_checkpoints(result), alias)
            verdict = task.no_learning(kind, names, tracker.epochs.last, baseline)
            if verdict is not None:  # the run still finishes: its curves and model say what went wrong
                log.warning("%s", verdict)
                tracker.flag_no_learning(verdict)
    if cfg.train.evaluate:  # the best model on the held-out rows (source.test), in a run nested under this one
        scoring = replace(cfg.predict, run=tracker.run_id)
        predict.run(replace(cfg, stage="evaluate", predict=scoring, tracking=replace(cfg.tracking, run_name=None)), job)
    metric = cfg.optimized_metric
    last = tracker.epochs.last
    log.info("finished: %s %.4f; %s", metric, last[metric], mlflow_store.run_link(tracker.uri, tracker.run_id))
    return JobResult(tracker.run_id, {k: last[k] for k in tracker.epochs.metrics}, tracker.model_uri())


def report_cache(data: preprocess.TrainingData, tracker: Tracker) -> threading.Thread:
    """Say what ``ingest.cache`` holds, on the console and in MLflow, once it is built: a helper thread
    waits while training reads the first pieces. A piece that failed to build fails training itself,
    which names the cause; this thread then says nothing."""

    def wait_and_report() -> None:
        try:
            built = {name: cache.built() for name, cache in data.caches.items()}
        except RayError:
            return
        summary = data.plan.summary(built)
        log.info("ingest: %s", summary)
        tracker.log_cache(summary, built)

    thread = threading.Thread(target=wait_and_report, name="cache-report", daemon=True)
    thread.start()
    return thread


@contextmanager
def resume_hint(tracker: Tracker) -> Iterator[None]:
    """On Ctrl-C or SIGTERM, say how to continue the run."""
    try:
        yield
    except (KeyboardInterrupt, SystemExit):
        name = tracker.name
        log.warning(
            "interrupted: MLflow run %r ends KILLED; its checkpoints stay. Continue it with the same "
            "command plus: train.resume=true tracking.run_name=%s",
            name,
            name,
        )
        raise


def ray_lost(tracker: Tracker, what: str) -> None:
    """Ray went away under training (:mod:`pipeline.runtime.lifeline`): the run ends FAILED, saying how to continue."""
    name = tracker.name
    err = PipelineError(
        f"Ray was lost under the run: {what} (a head node or raylet killed, by an OOM killer or with its "
        f"machine). MLflow run {name!r} is recorded FAILED; its checkpoints stay in {tracker.storage.uri}. Once "
        f"Ray is back, continue it with the same command plus: train.resume=true tracking.run_name={name}"
    )
    tracker.close(err)
    log.error("%s", err)


class JobEvents:
    """What a training job's driver does with each worker event (an :class:`pipeline.training.relay.EventHandler`)."""

    def __init__(self, tracker: Tracker, run_dir: str, progress: console.Progress):
        self.tracker, self.run_dir, self.progress = tracker, run_dir, progress

    def step_taken(self, event: StepTaken) -> None:
        self.tracker.epochs.log_startup(event.at, event.epoch)
        if event.log:
            self.tracker.epochs.log_step_loss(event.loss, event.global_step)
        self.progress.update(event.epoch, event.step, event.loss)

    def worker_started(self, event: WorkerStarted) -> None:
        append_record(self.run_dir, "workers.jsonl", asdict(event))

    def epoch_reported(self, event: EpochReported) -> None:
        """A report whose ranks :mod:`pipeline.training.relay` checked to agree, rank 0's first."""
        append_record(self.run_dir, "metrics.jsonl", {"checkpoint": event.checkpoint, "ranks": event.ranks})
        self.tracker.epochs.log_epoch(event.ranks[0], event.checkpoint)
        self.progress.epoch_done(event.ranks[0])

    def checkpoint_restored(self, event: CheckpointRestored) -> None:
        self.tracker.epochs.log_restore(event.epoch)
        self.progress.restored(event.epoch, event.workers)

    def close(self) -> None:
        self.progress.close()
