"""Checkpoints within an epoch: when one is due in the workers (every ``train.checkpoint_every``, or at once on a
stop with notice), every rank agreeing on the step; and, on the driver, a stop with notice (SIGTERM, Ctrl-C,
``ray job stop``, a spot notice) passed to the workers, waited on for at most ``train.stop_grace_s``.

The driver and the workers meet through a :class:`Notice` actor; each worker waits on it from a thread (one call
that returns when the notice comes: no polling), and the ranks agree at each optimizer step with a one-number
all-reduce on a gloo group, started at one step and read at the next (it overlaps a step of training: the GPU never
waits on it).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

import ray
import torch
import torch.distributed as dist

from pipeline.config import TrainConfig
from pipeline.training.events import StepCheckpointed
from pipeline.training.parallel import world_size

log = logging.getLogger(__name__)


@ray.remote(num_cpus=0)
class Notice:
    """The driver's word that the command is stopping, and the workers' answer once their checkpoint is saved. An
    async actor: each side waits on the other in one call, no polling."""

    def __init__(self) -> None:
        self.stopping, self.saved = asyncio.Event(), asyncio.Event()
        self.checkpoint: StepCheckpointed | None = None

    def stop(self) -> None:
        self.stopping.set()

    async def stopped(self) -> bool:
        """Returns once the command is stopping: each worker keeps one such call waiting (a worker polling ten
        times a second cost the quick start 3.7 CPU-seconds of the actor's over its second epoch)."""
        await self.stopping.wait()
        return True

    def checkpointed(self, saved: StepCheckpointed) -> None:
        self.checkpoint = saved
        self.saved.set()

    async def answer(self) -> StepCheckpointed:
        """Returns the checkpoint the workers saved on the notice, once they have."""
        await self.saved.wait()
        return self.checkpoint


def checkpoint_before_stop(
    notice: ray.actor.ActorHandle, grace_s: float, meanwhile: Callable[[], None] = lambda: None
) -> StepCheckpointed | None:
    """On the driver, the command stopping: ask the workers for a checkpoint at the step they are on, run
    ``meanwhile`` (the stop recorded while they save), and wait for it at most ``grace_s`` (a second signal ends the
    wait at once); the checkpoint, None when none came in time. ``ray.wait``, not ``ray.get(timeout=)``: on a busy
    machine the answer can come after the grace, and a ``GetTimeoutError`` here would end the run FAILED, or not at
    all before ``ray job stop``'s SIGKILL."""
    notice.stop.remote()
    answer = notice.answer.remote()
    meanwhile()
    ready, _ = ray.wait([answer], timeout=grace_s)
    if not ready:
        log.warning("stopping: no checkpoint within train.stop_grace_s=%gs; a resume starts from the last one", grace_s)
        return None
    saved = ray.get(answer)
    log.warning("stopping: checkpointed at epoch %d, step %d", saved.epoch + 1, saved.step)
    return saved


class Due:
    """In each worker: whether a checkpoint is due after an optimizer step, the same answer on every rank."""

    def __init__(self, train: TrainConfig, notice: ray.actor.ActorHandle | None):
        self.every_steps, self.every_s = train.step_checkpoints()
        self.notice = notice if train.checkpoint_on_stop else None
        self.stopping = threading.Event()
        self.last = time.monotonic()
        if self.notice is not None:
            threading.Thread(target=self.watch, name="stop-notice", daemon=True).start()
        self.group, self.pending = None, None
        if world_size() > 1 and (self.notice is not None or self.every_s is not None):
            self.group = dist.new_group(backend="gloo")  # a CPU group: the agreement never syncs a GPU

    def watch(self) -> None:
        """Waits for the driver's notice; the notice gone is one too: it lives with the driver, so the driver's
        process or node is going (a machine's shutdown SIGTERMs Ray's processes with the driver's)."""
        try:
            ray.get(self.notice.stopped.remote())
        except ray.exceptions.RayActorError:
            log.warning("the driver's stop notice is gone with the driver: checkpointing at this step")
            self.notice = None
        self.stopping.set()

    def check(self, updates: int) -> tuple[bool, bool]:
        """After optimizer step ``updates`` of the run: (a checkpoint is due, the command is stopping)."""
        local = torch.tensor([self.stopping.is_set(), self.timed_out()], dtype=torch.int32)
        agreed = local
        if self.group is not None:  # the last step's flags, over every rank; this step's go out now
            work, agreed = self.pending or (None, torch.zeros(2, dtype=torch.int32))
            if work is not None:
                work.wait()
            self.pending = dist.all_reduce(local, op=dist.ReduceOp.MAX, group=self.group, async_op=True), local
        stopping, timed = bool(agreed[0]), bool(agreed[1])
        stepped = self.every_steps is not None and updates % self.every_steps == 0
        return stepped or timed or stopping, stopping

    def timed_out(self) -> bool:
        return self.every_s is not None and time.monotonic() - self.last >= self.every_s

    def saved(self) -> None:
        """A checkpoint was taken: the minutes count from now, and the flags in flight, from before it, go."""
        self.last = time.monotonic()
        if self.pending is not None:
            self.pending[0].wait()
            self.pending = None
