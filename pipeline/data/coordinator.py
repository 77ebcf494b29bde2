"""The job's one data actor (started on the driver's node, asked by the tasks that gather each epoch): the epoch
the training workers are reading, and the windows of every streamed split (:mod:`pipeline.data.stream`).

It keeps the plan and the object refs of what was read, never the bytes: asked for a window, it has the job's
readers (:class:`pipeline.data.stream.Reader`, one per preprocessing node, started here for each placement a
split asks for) read an equal share of it each, and the next window with it, read while this one's rows are
gathered. The readers own what they read and keep it until the coordinator lets the window go: once every task
of it has asked and a window two later is asked for (the store holds a window, the next and the last). A
gathering task asks it twice (the epoch, and a streamed split's window), whatever the batches it hands on: one
small call per ~1,000 rows.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import numpy as np
import ray

from pipeline.data.pieces import window_groups, window_tasks
from pipeline.data.stream import Plan, start_readers


@ray.remote(num_cpus=0)
class Coordinator:
    """The epoch being read, and each streamed split's windows: those held or being read, how many of a window's
    tasks have asked for it, the readers, and the bytes each node has read."""

    def __init__(self) -> None:
        self.epoch = 0
        self.trained: ray.ObjectRef | None = None  # the rows of the epoch trained on before a stop (resumed)
        self.plans: dict[str, Plan] = {}
        # (split, epoch * windows + window) -> the number of its read, and its (pieces, sizes) once read
        self.held: dict[tuple[str, int], tuple[int, asyncio.Future]] = {}
        self.reads_started = 0
        self.newest: dict[str, int] = {}  # split -> the newest window asked for
        self.asked: Counter[tuple[str, int]] = Counter()  # how many of a window's tasks have asked for it
        self.readers: dict[str, list] = {}  # a placement (repr) -> the readers on its nodes
        self.read_bytes: Counter[str] = Counter()  # node id -> bytes read there

    def set_epoch(self, epoch: int, trained: np.ndarray | None = None) -> None:
        """The training workers, before each pass: Ray Data's split coordinator starts a pass only once every
        worker has asked for it, so no task of the pass reads an older value. ``trained``: a resumed epoch's rows
        trained on before the stop (:mod:`pipeline.training.ledger`'s packed bits), which its pass leaves out."""
        if trained is not None or epoch != self.epoch:
            self.trained = None if trained is None else ray.put(trained)
        self.epoch = epoch

    def get_epoch(self) -> int:
        return self.epoch

    def position(self) -> tuple[int, ray.ObjectRef | None]:
        """The epoch, and the rows of it already trained on (a ref to their packed bits; None: none)."""
        return self.epoch, self.trained

    def reads(self) -> dict[str, int]:
        """Bytes read so far, per node id."""
        return dict(self.read_bytes)

    async def prefetch(self, split: str, plan: Plan) -> None:
        """Start reading the first window of ``split``, streamed as ``plan`` says."""
        self.plans.setdefault(split, plan)
        self.start(split, 0)

    async def window(self, split: str, plan: Plan, epoch: int, index: int) -> tuple[list[ray.ObjectRef], list[list]]:
        """Window ``index`` of ``split``'s epoch ``epoch`` (``plan``: how it streams), once read: its pieces and,
        per row group, ``[(rows, bytes)]``."""
        self.plans.setdefault(split, plan)
        key = epoch * plan.windows + index
        newest = self.newest[split] = max(self.newest.get(split, key), key)
        self.start(split, key)  # read already, unless a task retried after its window went
        _, window = self.held[split, key]
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
        """Let window ``key`` of ``split`` go: once read, its readers release its pieces (a task that still
        gathers from them keeps them alive)."""
        read, window = self.held.pop((split, key))
        where = repr(self.plans[split].where)
        window.add_done_callback(lambda _: [reader.release.remote(read) for reader in self.readers.get(where, [])])

    async def holding(self, split: str) -> list[int]:
        """The windows of ``split`` it holds or is reading (epoch * windows + window): what the stores hold of it."""
        return sorted(key for name, key in self.held if name == split)

    def start(self, split: str, key: int) -> None:
        """Start reading window ``key`` of ``split`` unless it is read or being read."""
        if (split, key) not in self.held:
            self.reads_started += 1
            read = self.reads_started
            self.held[split, key] = read, asyncio.ensure_future(self.read(self.plans[split], key, read))

    async def read(self, plan: Plan, key: int, read: int) -> tuple[list[ray.ObjectRef], list[list]]:
        """The window's row groups, an equal share read by each reader of the plan's placement as its read number
        ``read``: their pieces' refs and sizes, in the window's order, once every reader is done."""
        where = repr(plan.where)
        if where not in self.readers:
            self.readers[where] = start_readers(plan.where)
        readers = self.readers[where]
        epoch, index = divmod(key, plan.windows)
        window = window_groups(len(plan.groups), plan.seed, epoch, plan.windows)[index]
        shares = [share for share in np.array_split(window, len(readers)) if len(share)]
        done = await asyncio.gather(
            *(
                reader.read.remote(read, [plan.groups[g] for g in share], plan.filesystem, plan.columns)
                for reader, share in zip(readers, shares)
            )
        )
        pieces, sizes = [], []
        for refs, share_sizes, node in done:
            self.read_bytes[node] += sum(size for _, size in share_sizes)
            pieces += refs
            sizes += [[size] for size in share_sizes]
        return pieces, sizes
