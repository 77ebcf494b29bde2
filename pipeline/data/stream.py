"""Streamed splits (built on the driver; a reader actor and Ray tasks run them): a split that is not cached
(``ingest.cache`` false, too large for the object store, or one epoch) read anew every epoch, the training
split in a new seeded order without an all-to-all pass, validation in its stored order.

Each epoch is :mod:`pipeline.data.pieces`' windows of raw rows: the job's :class:`StreamReader` actor reads a
window's row groups into Ray's object store (the columns as Arrow: no copy when a task maps them), reading the
next window ahead while the current one is consumed, and drops a window once the epoch has moved past it. Every
step then runs in the tasks that gather the window's rows, decoding included. A window holds what fits a third
of ``ingest.cache_share`` of the object store (this one, the next, and the last one's stragglers): a split that
fits is one window, a full shuffle every epoch; a larger one is mixed within windows of row groups drawn at
random from all of it.
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import ray

from pipeline.data.pieces import RowGroup, Windows, numpy_batch, read_group, window_groups, window_tasks

ROWS_PER_TASK = 1000  # an epoch's tasks each gather about this many rows


def read_piece(group: RowGroup, filesystem: pafs.FileSystem, columns: list[str]) -> tuple[pa.Table, list]:
    """One row group's ``columns`` and its file (``path``), as read; and ``[(rows, bytes)]``."""
    table = read_group(group, filesystem, columns)
    table = table.append_column("path", pa.array([group.file] * table.num_rows, pa.string()))
    return table, [(table.num_rows, table.nbytes)]


READ_THREADS = 4  # row groups a reader reads at once (Arrow releases the GIL while it reads)


@dataclass(frozen=True)
class Plan:
    """How a split streams: its row groups, what is read of them, its shuffle's seed (None: the stored order),
    and how each epoch is cut: into ``windows`` windows, read by ``tasks`` tasks."""

    groups: list[RowGroup]
    filesystem: pafs.FileSystem
    columns: list[str]
    seed: int | None
    windows: int
    tasks: int


@ray.remote(num_cpus=0)
class StreamReader:
    """Owns the pieces of the windows a job's streamed splits are reading: asked for a window, it has that one
    read, and the next once half the window's tasks have asked (so the read does not slow the window's start),
    and lets go of the others but the one before. It reads them itself, in threads: reading is mostly waiting
    on storage, and tasks that wait for a window would have Ray start more worker processes. One per job."""

    def __init__(self) -> None:
        self.plans: dict[str, Plan] = {}
        self.pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="read")
        # (split, epoch * windows + window) -> its (pieces, sizes), once read; how many of its tasks have asked
        self.held: dict[tuple[str, int], asyncio.Future] = {}
        self.asked: Counter[tuple[str, int]] = Counter()

    async def prefetch(self, split: str, plan: Plan) -> None:
        """Start reading the first window of ``split``, streamed as ``plan`` says."""
        self.plans.setdefault(split, plan)
        self.start(split, 0)

    async def window(self, split: str, plan: Plan, epoch: int, index: int) -> tuple[list[ray.ObjectRef], list[list]]:
        """Window ``index`` of ``split``'s epoch ``epoch`` (``plan``: how it streams), once read."""
        self.plans.setdefault(split, plan)
        key = epoch * plan.windows + index
        self.start(split, key)
        self.asked[split, key] += 1
        if self.asked[split, key] * 2 >= len(window_tasks(index, plan.tasks, plan.windows)):
            self.start(split, key + 1)
        for old in [k for k in self.held if k[0] == split and not key - 1 <= k[1] <= key + 1]:
            del self.held[old]
            self.asked.pop(old, None)
        return await asyncio.shield(self.held[split, key])

    async def holding(self, split: str) -> list[int]:
        """The windows of ``split`` it holds or is reading (epoch * windows + window): what its memory is."""
        return sorted(key for name, key in self.held if name == split)

    def start(self, split: str, key: int) -> None:
        """Start reading window ``key`` of ``split`` unless it is read or being read."""
        if (split, key) not in self.held:
            self.held[split, key] = asyncio.ensure_future(self.read(self.plans[split], key))

    async def read(self, plan: Plan, key: int) -> tuple[list[ray.ObjectRef], list[list]]:
        loop = asyncio.get_running_loop()
        epoch, index = divmod(key, plan.windows)
        groups = window_groups(len(plan.groups), plan.seed, epoch, plan.windows)[index]
        reads = [
            loop.run_in_executor(self.pool, read_piece, plan.groups[g], plan.filesystem, plan.columns) for g in groups
        ]
        read = await asyncio.gather(*reads)
        return [ray.put(table) for table, _ in read], [size for _, size in read]


@dataclass
class Stream:
    """A split's stream: the job's reader and the split's plan (what :func:`pipeline.data.pieces.dataset` reads)."""

    reader: ray.actor.ActorHandle
    split: str
    plan: Plan

    @property
    def windows(self) -> Windows:
        return Windows(self.plan.windows, self.plan.windows)

    @property
    def tasks(self) -> int:
        return self.plan.tasks

    def window(self, epoch: int, index: int, count: int) -> tuple[list[ray.ObjectRef], list[list]]:
        return ray.get(self.reader.window.remote(self.split, self.plan, epoch, index))

    @staticmethod
    def take(parts: dict[int, pa.Table], piece: np.ndarray, row: np.ndarray) -> dict[str, np.ndarray]:
        """The rows ``row[i]`` of pieces ``piece[i]``, in that order, as a numpy batch: only they are copied
        (each piece's rows taken from it alone: Arrow's take on many pieces at once copies them all first)."""
        grouped = np.argsort(piece, kind="stable")
        taken = [parts[int(p)].take(pa.array(row[grouped][piece[grouped] == p])) for p in np.unique(piece)]
        table = pa.concat_tables(taken, promote_options="permissive").combine_chunks()  # files may differ in types
        return numpy_batch(table.take(pa.array(np.argsort(grouped))))


def open_stream(
    reader: ray.actor.ActorHandle,
    split: str,
    groups: list[RowGroup],
    filesystem: pafs.FileSystem,
    columns: list[str],
    seed: int | None,
    budget: int,
) -> Stream:
    """``split``'s stream from ``groups`` (its shuffle's ``seed``, None: the stored order), its windows sized to
    ``budget`` bytes, added to ``reader``, which reads its first window at once (while Ray Train starts)."""
    total = sum(group.bytes for group in groups)
    windows = max(1, min(len(groups), math.ceil(total / max(budget, 1))))
    tasks = max(windows, math.ceil(sum(group.rows for group in groups) / ROWS_PER_TASK))
    plan = Plan(groups, filesystem, columns, seed, windows, tasks)
    reader.prefetch.remote(split, plan)
    return Stream(reader, split, plan)
