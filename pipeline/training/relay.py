"""Runs on the driver while ``fit()`` runs: the workers' events, taken off a Ray queue by a helper
thread, each report's ranks checked to agree, and handed to a job's :class:`EventHandler`
(:class:`pipeline.jobs.train.JobEvents`: progress to the console, each epoch's report to the tracker and
``metrics.jsonl``, restores to both); a Tune trial has none. This module never sees MLflow: Ray Train's
controller unpickles :class:`ReportRelay` from it, and MLflow's imports would delay every run's start.

The events are the dataclasses of :mod:`pipeline.training.events`: ``WorkerStarted``, ``StepTaken``,
``CheckpointRestored`` and ``MicroBatchHalved`` from :mod:`pipeline.training.worker`; ``EpochReported`` and
``StepCheckpointed`` (a checkpoint within an epoch) from :class:`ReportRelay` in Ray Train's controller.
"""

from __future__ import annotations

import math
import threading
from contextlib import contextmanager, suppress
from typing import Protocol

import ray.train
from ray.exceptions import RayError
from ray.util.queue import Empty, Queue

from pipeline.common.errors import PipelineError
from pipeline.common.metrics import is_task_metric
from pipeline.training.events import (
    STEP_KEY,
    CheckpointRestored,
    EpochReported,
    MicroBatchHalved,
    StepCheckpointed,
    StepTaken,
    WorkerStarted,
)

# How long the driver's thread waits on the queue per call. Each call is a message to the queue actor,
# so a short wait costs CPU all run long; the end of a run wakes the thread at once with a None.
QUEUE_WAIT_S = 5.0


class EventHandler(Protocol):
    """What the driver does with each kind of worker event, then once the run ends."""

    def worker_started(self, event: WorkerStarted) -> None: ...

    def step_taken(self, event: StepTaken) -> None: ...

    def epoch_reported(self, event: EpochReported) -> None: ...

    def checkpoint_restored(self, event: CheckpointRestored) -> None: ...

    def step_checkpointed(self, event: StepCheckpointed) -> None: ...

    def micro_batch_halved(self, event: MicroBatchHalved) -> None: ...

    def stopping(self, error: BaseException) -> None:
        """The command is stopping (Ctrl-C, SIGTERM), before the workers' checkpoint is waited on."""

    def close(self) -> None: ...


class ReportRelay(ray.train.UserCallback):
    """Runs in Ray Train's controller: every report (all ranks' metrics, the persisted checkpoint) to the driver."""

    def __init__(self, events: Queue):
        self.events = events

    def after_report(self, run_context, metrics: list[dict], checkpoint) -> None:
        self.events.put(reported(metrics, checkpoint.path if checkpoint else None))


def reported(metrics: list[dict], path: str | None) -> EpochReported | StepCheckpointed:
    """The event of a report (every rank's ``metrics``) whose checkpoint is at ``path`` in storage: a checkpoint
    within an epoch (no epoch's metrics), or an epoch's report."""
    first = metrics[0]
    if STEP_KEY in first:
        step, global_step, why = first[STEP_KEY], first["global_step"], first.get("why", "")
        return StepCheckpointed(epoch=first["epoch"], step=step, global_step=global_step, checkpoint=path, why=why)
    return EpochReported(metrics, path)


def checked_ranks(report: EpochReported) -> list[dict]:
    """A report's per-rank metrics in rank order, checked to be numbers and to agree."""
    ranks = sorted(report.ranks, key=lambda r: r["rank"])
    check_finite(ranks[0])
    check_ranks_agree(ranks)
    return ranks


def check_finite(metrics: dict) -> None:
    """An epoch whose metrics hold NaN or inf fails the run, before they reach MLflow."""
    bad = {key: value for key, value in metrics.items() if isinstance(value, float) and not math.isfinite(value)}
    if bad:
        raise PipelineError(
            f"{', '.join(f'{key} {value}' for key, value in bad.items())} after epoch {metrics['epoch'] + 1}: the "
            "model's outputs are not finite numbers (its weights, or the rows' features, hold NaN or inf). Check "
            "the features for NaN/inf, lower optim.lr or clip the gradients with train.grad_clip."
        )


def check_ranks_agree(ranks: list[dict]) -> None:
    """DDP replicas must hold identical weights and, after the all-reduce, identical metrics."""
    for key in ("weights_sha256", "val_loss", *filter(is_task_metric, ranks[0])):
        values = {r[key] for r in ranks}
        if len(values) > 1:
            raise PipelineError(f"training workers disagree on {key} after epoch {ranks[0]['epoch']}: {values}.")


@contextmanager
def relayed(events: Queue, handler: EventHandler | None):
    """A driver thread checks each report's ranks (:func:`checked_ranks`: a disagreement fails the run) and
    hands every event to ``handler``, if any, while the body runs; then the queue is drained and whatever
    a check or the handler raised is raised here. A Tune trial has no handler: its reports reach the
    sweep's driver through Tune."""
    stop, errors = threading.Event(), []

    handles = (
        {}
        if handler is None
        else {
            WorkerStarted: handler.worker_started,
            StepTaken: handler.step_taken,
            EpochReported: handler.epoch_reported,
            CheckpointRestored: handler.checkpoint_restored,
            StepCheckpointed: handler.step_checkpointed,
            MicroBatchHalved: handler.micro_batch_halved,
        }
    )

    def dispatch(event) -> None:
        if isinstance(event, EpochReported):
            event = EpochReported(checked_ranks(event), event.checkpoint)
        if type(event) in handles:
            handles[type(event)](event)

    def relay() -> None:
        while True:
            try:
                event = events.get(timeout=QUEUE_WAIT_S)
            except Empty:
                if stop.is_set():
                    break
                continue
            if event is None:  # the end of the run
                break
            try:
                dispatch(event)
            except BaseException as err:  # raised on the main thread once fit() returns
                errors.append(err)
        if handler is not None:
            handler.close()

    thread = threading.Thread(target=relay, name="event-relay", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        with suppress(RayError):  # a lost queue actor: the thread sees `stop` within QUEUE_WAIT_S instead
            events.put(None)
        thread.join()
    if errors:
        raise errors[0]
