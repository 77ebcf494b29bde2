"""One training job on the driver, built in the order its parts need each other and run top to bottom by
:class:`TrainingJob`, the one owner of a job (the command line's, ``pipeline.train``'s, a sweep's):

    check     config, data, storage and start weights; Ray started; the cluster's checks  (preflight)
    datasets  each split read lazily, cached or streamed, with its transforms           (preprocess)
    record    the MLflow run, with the splits, the ingest plan and the start weights    (Tracker)
    storage   where the checkpoints go                                                  (run_storage)
    fit       Ray Train's TorchTrainer to the end, each worker event to the record      (trainer.fit)
    finish    the models logged and the best registered; a run that learned nothing flagged
    evaluate  with train.evaluate, the best model on the held-out rows                  (predict)

A Tune trial is the same job (:class:`pipeline.jobs.trial.TrialJob`, in Tune's trial actor), overriding these
steps: check reads only the sources and start weights (the sweep's driver checked the rest and Ray is up);
record, finish and evaluate are the driver's (TrialRecorder); storage is under the trial's Tune id; fit reports
to Tune.

Every check that can fail on the user's input runs before the MLflow run is created: a single run that fails
them leaves nothing in MLflow; a sweep's job records them as a FAILED child run, so the sweep shows every job.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, replace

import ray.train
from ray.exceptions import RayError

from pipeline.common import console
from pipeline.common.errors import PipelineError, redact
from pipeline.config import PipelineConfig, Stage
from pipeline.data import preprocess, source
from pipeline.jobs import predict, preflight
from pipeline.jobs.job import Job, JobResult, append_record
from pipeline.runtime import filesystems, lifeline
from pipeline.runtime.filesystems import RunStorage
from pipeline.tracking import mlflow_store
from pipeline.tracking.tracker import Tracker
from pipeline.training import events, finetune, task, trainer

log = logging.getLogger(__name__)


class TrainingJob:
    """One training job: ``TrainingJob(cfg, job).run()``. Each step below is a method a Tune trial may override;
    the parts each step builds are attributes, set in the order ``run`` reads."""

    def __init__(self, cfg: PipelineConfig, job: Job, inputs: preflight.Inputs | None = None):
        self.cfg, self.job = cfg, job
        job.run_dir = os.path.abspath(job.run_dir)
        self.inputs = inputs  # checked before Ray started (pipeline.api.run_job), or None: check checks them
        self.hint: ResumeHint | None = None  # how to continue the run, once it exists (record)
        self.splits: dict[str, source.Split] = {}
        self.initial: finetune.Initial | None = None  # the weights training starts from (finetune.weights)
        self.tracker: Tracker | None = None  # the job's MLflow run (None in a Tune trial: its driver records it)

    def run(self) -> JobResult | None:
        console.quiet_libraries()
        try:
            self.check()
            data = self.datasets()
        except PipelineError as err:
            failed_before_run(self.cfg, self.job, err)
            raise
        with data, self.record(data):
            storage = self.storage()
            result = self.fit(data, storage)
            self.finish(data, result)
        return self.evaluate()

    def check(self) -> None:
        """Every check before the run exists, Ray started between them (:mod:`pipeline.jobs.preflight`)."""
        self.splits, self.initial = preflight.check(self.cfg, self.job.startup, self.inputs)

    def datasets(self) -> preprocess.TrainingData:
        """Each split's dataset; with ``ingest.standardize``, a pass over the training split, where a value it
        cannot use fails."""
        data = preprocess.training_data(self.cfg, self.splits)
        self.job.startup.mark("data")
        if data.mixing is not None and (warning := data.mixing.warning()):
            log.warning("%s", warning)  # before training: a split its windows cannot mix
        return data

    @contextmanager
    def record(self, data: preprocess.TrainingData) -> Iterator[None]:
        """The job's MLflow run, open while the block runs: it ends FINISHED, or FAILED / KILLED with the error."""
        job = self.job
        os.makedirs(job.run_dir, exist_ok=True)
        self.tracker = tracker = Tracker.open(self.cfg, job)
        log.info("MLflow run %s in %s; outputs in %s", tracker.run_id, redact(tracker.uri), job.run_dir)
        self.hint = ResumeHint(tracker)
        with tracker, self.hint.on_stop():
            tracker.log_data(self.splits, data.statistics)
            tracker.log_ingest(shuffle=data.mixing.summary() if data.mixing else None, device=data.device_steps())
            if data.device_steps():
                log.info("on the training device, every epoch: %s", data.device_steps())
            if self.initial is not None:
                log.info("finetune: %s", self.initial.summary())
                tracker.log_start_weights(self.initial)
            tracker.epochs.expect_rows(data.rows, self.cfg.ingest.drop_last)
            self.job.startup.mark("run")
            yield

    def storage(self) -> RunStorage:
        """Where the checkpoints go: the run's own directory, which a resumed run continues from; from here on,
        training never waits on the tracking server."""
        tracker = self.tracker
        storage = filesystems.run_storage(self.cfg.storage, self.job.run_dir, tracker.run_id, tracker.resume_from)
        tracker.set_storage(storage)
        tracker.record.spool_to(self.job.run_dir)
        return storage

    def fit(self, data: preprocess.TrainingData, storage: RunStorage) -> ray.train.Result:
        """Training to the end, each worker event recorded as it comes, the cache's figures once it is built."""
        cfg, tracker = self.cfg, self.tracker
        reporter = report_cache(data, tracker)
        progress = console.Progress(cfg.train.epochs, trainer.epoch_steps(cfg, data), cfg.tracking.data_wait_warning)
        handler = JobEvents(tracker, self.job, progress, self.hint)
        with lifeline.watched(lambda what: ray_lost(tracker, what)), progress:
            self.job.startup.mark("fit")
            result = trainer.fit(cfg, data, storage, handler, self.initial)
        reporter.join()  # training read every row, so the cache is built: its figures land before the run ends
        reads = data.reads()
        if reads is not None:
            log.info("ingest: %s", reads)
        tracker.log_ingest(reads=reads)
        return result

    def finish(self, data: preprocess.TrainingData, result: ray.train.Result) -> None:
        """The checkpoints' models logged, the best registered (a sweep's: its best job's, when it ends), and a
        run whose last validation is no better than a constant guess flagged: it still finishes."""
        cfg, tracker = self.cfg, self.tracker
        if tracker.epochs.last is None:
            raise PipelineError("training finished without reporting an epoch.")
        tracker.finish_models(
            trainer.kept_checkpoints(result, tracker.storage),
            None if self.job.sweep_dir else cfg.tracking.register_alias,
        )
        kind, names = cfg.task.type, cfg.task.metrics
        baseline = task.constant_baseline(kind, names, source.labels(self.splits["valid"]))
        verdict = task.no_learning(kind, names, tracker.epochs.last, baseline)
        if verdict is not None:
            log.warning("%s", verdict)
            tracker.flag_no_learning(verdict)

    def evaluate(self) -> JobResult:
        """With ``train.evaluate``, the best model scored on the held-out rows (``source.test``) in a run nested
        under this one; then what the job hands back."""
        cfg, tracker = self.cfg, self.tracker
        if cfg.train.evaluate:
            scoring, tracking = replace(cfg.predict, run=tracker.run_id), replace(cfg.tracking, run_name=None)
            predict.run(replace(cfg, stage=Stage.evaluate, predict=scoring, tracking=tracking), self.job)
        last, metric = tracker.epochs.last, cfg.optimized_metric
        log.info("finished: %s %.4f; %s", metric, last[metric], mlflow_store.run_link(tracker.uri, tracker.run_id))
        return JobResult(tracker.run_id, {k: last[k] for k in tracker.epochs.metrics}, tracker.model_uri())


def failed_before_run(cfg: PipelineConfig, job: Job, err: PipelineError) -> None:
    """A check failed before the job's run existed: a sweep's job is recorded all the same, a FAILED child run
    with the error (a sweep keeps a record of every job it tried); a single job leaves nothing in MLflow."""
    if job.sweep_dir:
        Tracker.open(cfg, job).end("FAILED", err)


def run(cfg: PipelineConfig, job: Job, inputs: preflight.Inputs | None = None) -> JobResult:
    """Run one training job from its typed config (:class:`TrainingJob`), its ``inputs`` checked already or not."""
    return TrainingJob(cfg, job, inputs).run()


def report_cache(data: preprocess.TrainingData, tracker: Tracker) -> threading.Thread:
    """Say what ``ingest.cache`` holds, on the console and in MLflow, once it is built: a helper thread
    waits while training reads the first pieces. A piece that failed to build fails training itself,
    which names the cause; this thread then says nothing."""

    def wait_and_report() -> None:
        try:
            built = {name: cache.figures() for name, cache in data.caches.items()}
        except RayError:
            return
        summary = data.plan.summary(built)
        log.info("ingest: %s", summary)
        tracker.log_cache(summary, built)

    thread = threading.Thread(target=wait_and_report, name="cache-report", daemon=True)
    thread.start()
    return thread


class ResumeHint:
    """How to continue a run stopped by Ctrl-C or SIGTERM, said once: as the stop comes during training (before
    the stop is recorded and the checkpoint awaited, which ``ray job stop``'s SIGKILL, 3 s after its SIGTERM, may
    cut short), else as the run's block ends on the stop."""

    def __init__(self, tracker: Tracker):
        self.tracker, self.said = tracker, False

    def say(self) -> None:
        if not self.said:
            name = self.tracker.name
            log.warning(
                "interrupted: MLflow run %r ends KILLED; its checkpoints stay. Continue it with the same "
                "command plus: train.resume=true tracking.run_name=%s",
                name,
                name,
            )
            self.said = True

    @contextmanager
    def on_stop(self) -> Iterator[None]:
        try:
            yield
        except (KeyboardInterrupt, SystemExit):
            self.say()
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

    def __init__(self, tracker: Tracker, job: Job, progress: console.Progress, hint: ResumeHint):
        self.tracker, self.run_dir, self.progress, self.job, self.hint = tracker, job.run_dir, progress, job, hint

    def step_taken(self, event: events.StepTaken) -> None:
        startup = self.job.startup
        if event.phases is not None and "first_step" not in startup.at:  # the job's first worker group's
            for phase, at in {**event.phases, "first_step": event.at}.items():
                startup.mark(phase, at)
            self.tracker.epochs.log_startup(startup.seconds(self.job.started_at), event.epoch)
            log.info("%s", startup.line(self.job.started_at))
        if event.log:
            self.tracker.epochs.log_step_loss(event.loss, event.global_step, event.at)
        self.progress.update(event.epoch, event.step, event.loss)

    def worker_started(self, event: events.WorkerStarted) -> None:
        append_record(self.run_dir, "workers.jsonl", asdict(event))

    def epoch_reported(self, event: events.EpochReported) -> None:
        """A report whose ranks :mod:`pipeline.training.relay` checked to agree, rank 0's first."""
        append_record(self.run_dir, "metrics.jsonl", {"checkpoint": event.checkpoint, "ranks": event.ranks})
        self.tracker.epochs.log_epoch(event.ranks[0], event.checkpoint)
        self.tracker.log_profile()
        self.progress.epoch_done(event.ranks[0])

    def checkpoint_restored(self, event: events.CheckpointRestored) -> None:
        # the workers restore from the newest whole checkpoint in storage, dropping the records of what it abandons:
        # the epochs before it whose reports never came (an earlier attempt's too) are logged now
        for path, metrics in self.tracker.epochs.reconcile(self.tracker.storage):
            append_record(self.run_dir, "metrics.jsonl", {"checkpoint": path, "ranks": [metrics]})
        self.tracker.epochs.log_restore(event.epoch, event.global_step)
        self.progress.restored(event.epoch, event.workers, event.step)

    def step_checkpointed(self, event: events.StepCheckpointed) -> None:
        self.tracker.epochs.log_step_checkpoint(event.global_step)
        log.info("checkpointed at epoch %d, step %d: %s", event.epoch + 1, event.step, event.why)

    def micro_batch_halved(self, event: events.MicroBatchHalved) -> None:
        log.warning(
            "train.micro_batch=auto: out of memory with %d rows per forward at epoch %d, step %d; %d from now on "
            "(the batch and its optimizer step unchanged)",
            event.was,
            event.epoch + 1,
            event.step,
            event.rows,
        )

    def stopping(self, error: BaseException) -> None:
        """How to continue said, and the stop recorded, while the workers save: ray job stop's SIGKILL may come
        while the checkpoint is awaited."""
        self.hint.say()
        self.tracker.stop_first(error)

    def close(self) -> None:
        self.progress.close()
