"""The streamed shuffle (built on the driver; a reader actor and Ray tasks run it): a split read anew every
epoch, in a new seeded order, without an all-to-all pass, for data that is not cached (``ingest.cache``
false, or too large for the object store).

Each epoch is :mod:`pipeline.pieces`' windows of raw rows: a :class:`StreamReader` actor reads a window's row
groups into Ray's object store (one task per row group, the columns as Arrow: no copy when a task maps them),
reading the next window ahead while the current one is consumed, and drops a window once the epoch has moved
past it. Every step then runs in the tasks that gather the window's rows, decoding included. A window holds
what fits a third of ``ingest.cache_share`` of the object store (this one, the next, and the last one's
stragglers): a split that fits is one window, a full shuffle every epoch; a larger one is mixed within
windows of row groups drawn at random from all of it.
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

from pipeline.pieces import RowGroup, Windows, numpy_batch, read_group, window_groups, window_tasks

ROWS_PER_TASK = 1000  # an epoch's tasks each gather about this many rows


def read_piece(group: RowGroup, filesystem: pafs.FileSystem, columns: list[str]) -> tuple[pa.Table, list]:
    """One row group's ``columns`` and its file (``path``), as read; and ``[(rows, bytes)]``."""
    table = read_group(group, filesystem, columns)
    table = table.append_column("path", pa.array([group.file] * table.num_rows, pa.string()))
    return table, [(table.num_rows, table.nbytes)]


READ_THREADS = 4  # row groups a reader reads at once (Arrow releases the GIL while it reads)


@ray.remote(num_cpus=0)
class StreamReader:
    """Owns the pieces of the windows an epoch is reading: asked for a window, it has that one read, and the
    next once half the window's tasks have asked (so the read does not slow the window's start), and lets go
    of the others but the one before. It reads them itself, in threads: reading is mostly waiting on
    storage, and tasks that wait for a window would have Ray start more worker processes."""

    def __init__(
        self,
        groups: list[RowGroup],
        filesystem: pafs.FileSystem,
        columns: list[str],
        seed: int,
        windows: int,
        tasks: int,
    ):
        self.groups, self.filesystem, self.columns = groups, filesystem, columns
        self.seed, self.windows, self.tasks = seed, windows, tasks
        self.pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="read")
        self.held: dict[int, asyncio.Future] = {}  # epoch * windows + window -> its (pieces, sizes), once read
        self.asked: Counter[int] = Counter()  # how many of a window's tasks have asked for it

    async def window(self, epoch: int, index: int) -> tuple[list[ray.ObjectRef], list[list]]:
        key = epoch * self.windows + index
        self.start(key)
        self.asked[key] += 1
        if self.asked[key] * 2 >= len(window_tasks(index, self.tasks, self.windows)):
            self.start(key + 1)
        for old in [k for k in self.held if not key - 1 <= k <= key + 1]:
            del self.held[old]
            self.asked.pop(old, None)
        return await asyncio.shield(self.held[key])

    async def prefetch(self, key: int) -> None:
        self.start(key)

    async def holding(self) -> list[int]:
        """The windows it holds or is reading (epoch * windows + window): what its memory is."""
        return sorted(self.held)

    def start(self, key: int) -> None:
        """Start reading window ``key`` (epoch * windows + window) unless it is read or being read."""
        if key not in self.held:
            self.held[key] = asyncio.ensure_future(self.read(*divmod(key, self.windows)))

    async def read(self, epoch: int, index: int) -> tuple[list[ray.ObjectRef], list[list]]:
        loop = asyncio.get_running_loop()
        groups = window_groups(len(self.groups), self.seed, epoch, self.windows)[index]
        reads = [
            loop.run_in_executor(self.pool, read_piece, self.groups[g], self.filesystem, self.columns) for g in groups
        ]
        read = await asyncio.gather(*reads)
        return [ray.put(table) for table, _ in read], [size for _, size in read]


@dataclass
class Stream:
    """A split's stream: its reader, and how its epochs are cut (what :func:`pipeline.pieces.dataset` reads)."""

    reader: ray.actor.ActorHandle
    windows: Windows
    tasks: int

    def window(self, epoch: int, index: int, count: int) -> tuple[list[ray.ObjectRef], list[list]]:
        return ray.get(self.reader.window.remote(epoch, index))

    @staticmethod
    def take(parts: dict[int, pa.Table], piece: np.ndarray, row: np.ndarray) -> dict[str, np.ndarray]:
        """The rows ``row[i]`` of pieces ``piece[i]``, in that order, as a numpy batch: only they are copied
        (each piece's rows taken from it alone: Arrow's take on many pieces at once copies them all first)."""
        grouped = np.argsort(piece, kind="stable")
        taken = [parts[int(p)].take(pa.array(row[grouped][piece[grouped] == p])) for p in np.unique(piece)]
        table = pa.concat_tables(taken, promote_options="permissive").combine_chunks()  # files may differ in types
        return numpy_batch(table.take(pa.array(np.argsort(grouped))))


def open_stream(
    groups: list[RowGroup], filesystem: pafs.FileSystem, columns: list[str], seed: int, budget: int, placement: dict
) -> Stream:
    """A reader for ``groups`` (``placement``: where it may run), its windows sized to ``budget`` bytes; the
    first window is read at once (while Ray Train starts its workers)."""
    total = sum(group.bytes for group in groups)
    windows = max(1, min(len(groups), math.ceil(total / max(budget, 1))))
    tasks = max(windows, math.ceil(sum(group.rows for group in groups) / ROWS_PER_TASK))
    reader = StreamReader.options(**placement).remote(groups, filesystem, columns, seed, windows, tasks)
    reader.prefetch.remote(0)
    return Stream(reader, Windows(windows, windows), tasks)
