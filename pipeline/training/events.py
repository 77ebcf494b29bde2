"""What the training workers and Ray Train's controller tell the driver during a run: the events that
:mod:`pipeline.training.relay` relays, as plain dataclasses. This module imports nothing else: the event queue's
actor unpickles every event, and importing Ray Train or the pipeline's config there would hold up each
worker's first event (a queue put waits for the actor).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class WorkerStarted:
    """Where a rank runs: its process, node, placement group (a Tune sweep's driver releases the group,
    workarounds.py) and copy of the code. A line of the run's ``workers.jsonl``."""

    rank: int
    pid: int
    node_id: str
    placement_group: str | None
    code: str


@dataclass(frozen=True, kw_only=True)
class StepTaken:
    """Rank 0's step and batch loss, once a second and every ``tracking.log_every_n_steps`` steps (``log``)."""

    epoch: int
    step: int  # within the epoch
    global_step: int
    log: bool
    loss: float
    at: float  # wall-clock time the step ended: the first one ends start-up
    phases: dict[str, float] | None = None  # with a worker group's first step: when its start-up phases ended


STEP_KEY = "epoch_step"  # in the report of a checkpoint taken within an epoch: the steps of the epoch done


@dataclass(frozen=True)
class CheckpointRestored:
    """Rank 0 loaded a checkpoint (a restarted or resized worker group, or a resumed run): training continues
    at ``epoch`` on ``workers`` workers, after ``step`` of its steps (0: at its start), at ``global_step``."""

    epoch: int
    workers: int
    step: int = 0
    global_step: int = 0


@dataclass(frozen=True, kw_only=True)
class StepCheckpointed:
    """A checkpoint within an epoch (``train.checkpoint_every``, a stop with notice), persisted at ``checkpoint``."""

    epoch: int
    step: int  # within the epoch
    global_step: int
    checkpoint: str | None
    why: str = ""  # what it was taken for: train.checkpoint_every, a node draining, the command stopping


@dataclass(frozen=True, kw_only=True)
class MicroBatchHalved:
    """``train.micro_batch=auto``: a batch ran out of memory on some rank, and every rank now takes ``rows`` rows per
    forward (``was`` before), from step ``step`` of ``epoch`` on."""

    epoch: int
    step: int
    was: int
    rows: int


@dataclass(frozen=True)
class EpochReported:
    """Every rank's metrics for an epoch, and where Ray Train persisted rank 0's checkpoint."""

    ranks: list[dict]
    checkpoint: str | None
