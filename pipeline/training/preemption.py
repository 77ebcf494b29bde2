"""Checkpoints within an epoch: when one is due in the workers (every ``train.checkpoint_every``, at once on a
stop with notice, or when Ray drains a node of the worker group: a spot node's notice), every rank agreeing on the
step; and, on the driver, a stop with notice (SIGTERM, Ctrl-C, ``ray job stop``) passed to the workers, waited on
for at most ``train.stop_grace_s``.

The driver and the workers meet through a :class:`Notice` actor; each worker waits on it from a thread (one call
that returns when the notice comes: no polling), and the ranks agree at each optimizer step with a few-number
all-reduce on a gloo group, started at one step and read at the next (it overlaps a step of training: the GPU never
waits on it). A drain is Ray Train's to see (its watcher polls Ray's draining nodes every 5 s and tells the
workers); the ranks ask it (``ray.train.get_preemption_info``, a barrier through Ray Train's synchronization actor)
at the same step, once every :data:`DRAIN_CHECK_S`: one call a worker every few seconds, not one a step.
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

STOPPING = "the command is stopping"  # why a checkpoint was taken, in its report, when the driver's notice asked for it
DRAIN_CHECK_S = 5.0  # how often the ranks ask Ray Train whether a node of theirs is draining: its own poll's interval
ENDED_CHECK_S = 0.5  # how often the driver, waiting for the stop's checkpoint, looks whether training has ended


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
    notice: ray.actor.ActorHandle,
    grace_s: float,
    meanwhile: Callable[[], None] = lambda: None,
    ended: threading.Event | None = None,
) -> StepCheckpointed | None:
    """On the driver, the command stopping: ask the workers for a checkpoint at the step they are on, run
    ``meanwhile`` (the stop recorded while they save), and wait for it at most ``grace_s`` (a second signal ends the
    wait at once), or until training has ``ended`` (its last epoch done, or its workers gone: none will answer); the
    checkpoint, None when none came. ``ray.wait``, not ``ray.get(timeout=)``: on a busy machine the answer can come
    after the grace, and a ``GetTimeoutError`` here would end the run FAILED, or not at all before ``ray job stop``'s
    SIGKILL."""
    notice.stop.remote()
    answer = notice.answer.remote()
    log.warning(
        "stopping: checkpoint at the step the workers are on, waited on at most %gs (a second signal ends the "
        "wait; train.stop_grace_s)",
        grace_s,
    )
    meanwhile()
    ended = ended or threading.Event()  # none given: only the grace ends the wait
    deadline, ready = time.monotonic() + grace_s, []
    while not ready and (left := deadline - time.monotonic()) > 0 and not ended.is_set():
        ready, _ = ray.wait([answer], timeout=min(left, ENDED_CHECK_S))
    if not ready:
        if ended.is_set():
            log.warning("stopping: training ended before a checkpoint at a step; a resume starts from the last one")
        else:
            log.warning(
                "stopping: no checkpoint within train.stop_grace_s=%gs; a resume starts from the last one", grace_s
            )
        return None
    saved = ray.get(answer)
    log.warning("stopping: checkpointed at epoch %d, step %d", saved.epoch + 1, saved.step)
    return saved


class Due:
    """In each worker: whether a checkpoint is due after an optimizer step, the same answer on every rank."""

    def __init__(self, train: TrainConfig, notice: ray.actor.ActorHandle | None, drains: bool = True):
        """``drains``: ask Ray Train about draining nodes (in a Ray Train worker only)."""
        self.every_steps, self.every_s = train.step_checkpoints()
        self.drains = drains
        self.notice = notice if train.checkpoint_on_stop else None
        self.stopping = threading.Event()
        self.last = self.drains_checked = time.monotonic()
        self.draining: set[str] = set()  # the drained nodes a checkpoint was taken for
        self.why = ""  # what the last checkpoint that came due was for
        self.ended = False  # training is over (end)
        if self.notice is not None:
            threading.Thread(target=self.watch, name="stop-notice", daemon=True).start()
        self.group, self.pending = None, None
        if world_size() > 1:
            self.group = dist.new_group(backend="gloo")  # a CPU group: the agreement never syncs a GPU

    def watch(self) -> None:
        """Waits for the driver's notice; the notice gone is one too: it lives with the driver, so the driver's
        process or node is going (a machine's shutdown SIGTERMs Ray's processes with the driver's)."""
        try:
            ray.get(self.notice.stopped.remote())
        except ray.exceptions.RayActorError:
            if self.ended:  # local mode: the worker is the driver's process, which ends the notice after training
                return
            log.warning("the driver's stop notice is gone with the driver: checkpointing at this step")
            self.notice = None
        self.stopping.set()

    def end(self) -> None:
        """Training is over: the notice's end says nothing more."""
        self.ended = True

    def check(self, updates: int) -> tuple[bool, bool]:
        """After optimizer step ``updates`` of the run: (a checkpoint is due, the command is stopping)."""
        now = time.monotonic()
        timed = self.every_s is not None and now - self.last >= self.every_s
        flags = [self.stopping.is_set(), timed, self.drains and now - self.drains_checked >= DRAIN_CHECK_S]
        local = agreed = torch.tensor(flags, dtype=torch.int32)
        if self.group is not None:  # the last step's flags, over every rank; this step's go out now
            work, agreed = self.pending or (None, torch.zeros(3, dtype=torch.int32))
            if work is not None:
                work.wait()
            self.pending = dist.all_reduce(local, op=dist.ReduceOp.MAX, group=self.group, async_op=True), local
        stopping, timed, ask = (bool(flag) for flag in agreed)
        stepped = self.every_steps is not None and updates % self.every_steps == 0
        self.why = STOPPING if stopping else "train.checkpoint_every"
        return stepped or timed or stopping or (ask and self.drained()), stopping

    def drained(self) -> bool:
        """Whether Ray Train says a node of this worker group is draining (a spot node's notice, ``ray drain-node``)
        that no checkpoint was taken for yet: asked by every rank at the same step (a barrier)."""
        self.drains_checked = time.monotonic()
        info = ray.train.get_preemption_info()
        if info is None or set(info.preempted_node_ids) <= self.draining:
            return False
        self.draining |= set(info.preempted_node_ids)
        deadline = (
            "none" if info.deadline_ms is None else time.strftime("%H:%M:%S", time.localtime(info.deadline_ms / 1e3))
        )
        self.why = (
            f"node(s) {', '.join(info.preempted_node_ids)} draining (ranks {info.preempted_ranks}, deadline {deadline})"
        )
        return True

    def saved(self) -> None:
        """A checkpoint was taken: the minutes count from now, and the flags in flight, from before it, go."""
        self.last = time.monotonic()
        if self.pending is not None:
            self.pending[0].wait()
            self.pending = None
