"""The job's one data actor (started on the driver's node, asked by the tasks that gather each epoch): the epoch
the training workers are reading, and the windows of every streamed split (:mod:`pipeline.data.stream`).

It keeps the plan and the object refs of what was read, never the bytes: asked for a window, it has each
preprocessing node alive read an equal share of it (:func:`pipeline.data.stream.read_window`, by the node's reader,
started here), and the next window with it, read while this one's rows are gathered. It owns what was read and
keeps it until it lets the window go: once every task of it has asked and a window two later is asked for (the
store holds a window, the next and the last). On a cluster it deals each window's parts to the tasks that gather
them, each a part held on its own node where one is left (:meth:`claim`), and counts the bytes each node read and
fetched from others. A gathering task asks it up to three times (the epoch, a streamed split's window, its part),
whatever the batches it hands on: a few small calls per ~1,000 rows.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import numpy as np
import ray

from pipeline.data.pieces import claim, window_groups, window_tasks
from pipeline.data.stream import Plan, read_window


@ray.remote(num_cpus=0)
class Coordinator:
    """The epoch being read; each streamed split's windows: those held or being read, how many of a window's
    tasks have asked for it; which task claimed which part of a window; the bytes each node read and fetched."""

    def __init__(self) -> None:
        self.epoch = 0
        self.trained: ray.ObjectRef | None = None  # the rows of the epoch trained on before a stop (resumed)
        self.plans: dict[str, Plan] = {}
        # (split, epoch * windows + window) -> its (pieces, sizes, nodes), once read
        self.held: dict[tuple[str, int], asyncio.Future] = {}
        self.newest: dict[str, int] = {}  # split -> the newest window asked for
        self.asked: Counter[tuple[str, int]] = Counter()  # how many of a window's tasks have asked for it
        self.readers: dict[str, dict] = {}  # a placement (repr) -> node id -> the reader there
        self.read_bytes: Counter[str] = Counter()  # node id -> bytes read there
        self.received_bytes: Counter[str] = Counter()  # node id -> bytes its tasks had sent from other nodes
        self.claims: dict[tuple[str, int, int], dict[int, int]] = {}  # (split, epoch, window) -> task -> part

    def set_epoch(self, epoch: int, trained: np.ndarray | None = None) -> None:
        """The training workers, before each pass: Ray Data's split coordinator starts a pass only once every
        worker has asked for it, so no task of the pass reads an older value. ``trained``: a resumed epoch's rows
        trained on before the stop (:mod:`pipeline.training.ledger`'s packed bits), which its pass leaves out."""
        if trained is not None or epoch != self.epoch:
            self.trained = None if trained is None else ray.put(trained)
        self.epoch = epoch
        self.claims = {key: parts for key, parts in self.claims.items() if key[1] >= epoch - 1}

    def get_epoch(self) -> int:
        return self.epoch

    def position(self) -> tuple[int, ray.ObjectRef | None]:
        """The epoch, and the rows of it already trained on (a ref to their packed bits; None: none)."""
        return self.epoch, self.trained

    def reads(self) -> tuple[dict[str, int], dict[str, int]]:
        """Bytes read so far, and bytes of pieces fetched from other nodes, per node id."""
        return dict(self.read_bytes), dict(self.received_bytes)

    def add_read(self, node: str, size: int) -> None:
        """A read task of Ray Data's route (:mod:`pipeline.data.epochs`) read ``size`` bytes on ``node``."""
        self.read_bytes[node] += size

    def received(self, node: str, size: int) -> None:
        """A gathering task on ``node`` had ``size`` bytes sent from other nodes (a part of theirs, gathered there)."""
        self.received_bytes[node] += size

    def claim(self, window: tuple[str, int, int], task: int, node: str, homes: list[str]) -> int:
        """The part of ``window`` (split, epoch, window) that gathering task ``task`` takes, running on ``node``
        (:func:`pipeline.data.pieces.claim`; ``homes``: each part's node)."""
        return claim(self.claims.setdefault(window, {}), task, node, homes)

    async def prefetch(self, split: str, plan: Plan) -> None:
        """Start reading the first window of ``split``, streamed as ``plan`` says."""
        self.plans.setdefault(split, plan)
        self.start(split, 0)

    async def window(
        self, split: str, plan: Plan, epoch: int, index: int
    ) -> tuple[list[ray.ObjectRef], list[list], list[str]]:
        """Window ``index`` of ``split``'s epoch ``epoch`` (``plan``: how it streams), once read: its pieces and,
        per row group, ``[(rows, bytes)]`` and the node that read it."""
        self.plans.setdefault(split, plan)
        key = epoch * plan.windows + index
        newest = self.newest[split] = max(self.newest.get(split, key), key)
        self.start(split, key)  # read already, unless a task retried after its window went
        window = self.held[split, key]
        self.asked[split, key] += 1
        for old in [k for name, k in self.held if name == split and k != key and self.done_with(split, k)]:
            self.drop(split, old)
        self.start(split, newest + 1)  # read ahead while this window's rows are gathered
        return await asyncio.shield(window)

    def done_with(self, split: str, key: int) -> bool:
        """Whether window ``key`` of ``split`` may go: each of its tasks has asked for it and a window two later
        has been asked for (its tasks are done with it), or it is more than an epoch behind (an epoch cut short)."""
        plan, newest = self.plans[split], self.newest[split]
        tasks = len(window_tasks(key % plan.windows, plan.tasks, plan.windows))
        return key < newest - plan.windows or (key < newest - 1 and self.asked[split, key] >= tasks)

    def drop(self, split: str, key: int) -> None:
        """Let window ``key`` of ``split`` go: its pieces, once read (a task that still gathers from them keeps
        them alive)."""
        self.held.pop((split, key))

    async def holding(self, split: str) -> list[int]:
        """The windows of ``split`` it holds or is reading (epoch * windows + window): what the stores hold of it."""
        return sorted(key for name, key in self.held if name == split)

    def start(self, split: str, key: int) -> None:
        """Start reading window ``key`` of ``split`` unless it is read or being read."""
        if (split, key) not in self.held:
            self.held[split, key] = asyncio.ensure_future(self.read(self.plans[split], key))

    async def read(self, plan: Plan, key: int) -> tuple[list[ray.ObjectRef], list[list], list[str]]:
        """The window's row groups, an equal share read on each preprocessing node: their pieces' refs, sizes and
        nodes, in the window's order, once every share is read."""
        epoch, index = divmod(key, plan.windows)
        window = window_groups(len(plan.groups), plan.seed, epoch, plan.windows)[index]
        readers = self.readers.setdefault(repr(plan.where), {})
        reads = read_window([plan.groups[g] for g in window], plan.filesystem, plan.columns, plan.where, readers)
        pieces, sizes, homes = [], [], []
        for refs, (share_sizes, node) in zip(reads, await asyncio.gather(*(refs[-1] for refs in reads))):
            self.read_bytes[node] += sum(size for _, size in share_sizes)
            pieces += refs[:-1]
            sizes += [[size] for size in share_sizes]
            homes += [node] * len(share_sizes)
        return pieces, sizes, homes
