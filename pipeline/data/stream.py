"""Streamed splits (planned on the driver; reader actors and the gathering tasks run them): a split that is not
cached (``ingest.cache`` false, too large for the object store, or one epoch) read anew every epoch, the
training split in a new seeded order without an all-to-all pass, validation in its stored order.

Each epoch is :mod:`pipeline.data.pieces`' windows of raw rows. A window's row groups are read by the job's
:class:`Reader` actors, one on each node that may run the split's first step (its resources and labels), an equal
share each, in threads (reading is mostly waiting on storage): each row group lands in the object store of the
node that read it, as Arrow columns (no copy when a task maps them), and reads grow with the preprocessing nodes
and their CPUs. The job's :class:`pipeline.data.coordinator.Coordinator` keeps the plan and the object refs of
what was read, never the bytes. Every step then runs in the tasks that gather the window's rows, decoding
included. A window holds what fits a third of ``ingest.cache_share`` of the preprocessing nodes' object stores
(this one, the next, and the last one's stragglers): a split that fits is one window, a full shuffle every
epoch; a larger one is mixed within windows of row groups drawn at random from all of it.
"""

from __future__ import annotations

import asyncio
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from pipeline.data.pieces import RowGroup, Windows, numpy_batch, read_group
from pipeline.runtime.cluster import placeable_nodes

ROWS_PER_TASK = 1000  # an epoch's tasks each gather about this many rows
READ_THREADS_PER_CPU = 2  # row groups a reader reads at once per CPU of its node (Arrow releases the GIL)


def read_piece(group: RowGroup, filesystem: pafs.FileSystem, columns: list[str]) -> pa.Table:
    """One row group's ``columns`` and its file (``path``), as read."""
    table = read_group(group, filesystem, columns)
    return table.append_column("path", pa.array([group.file] * table.num_rows, pa.string()))


@ray.remote(num_cpus=0)
class Reader:
    """Reads row groups on its node, in ``threads`` threads, into that node's object store; one per preprocessing
    node of a job, started and owned by its coordinator. Its own process rather than tasks: tasks that wait for a
    window would have Ray start more worker processes, and one per node holds no CPU a step could use."""

    def __init__(self, threads: int) -> None:
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="read")
        self.held: dict[int, list[ray.ObjectRef]] = {}  # a read's pieces, until the coordinator releases it

    async def read(
        self, read: int, groups: list[RowGroup], filesystem: pafs.FileSystem, columns: list[str]
    ) -> tuple[list[ray.ObjectRef], list[tuple[int, int]], str]:
        """``groups`` read at once: each one's object (stored on this node), its ``(rows, bytes)``, this node's id.
        The reader owns the objects and keeps them until :meth:`release` of ``read``: while it does, the tasks the
        coordinator hands them on to find them whatever their borrowing of them says."""
        loop = asyncio.get_running_loop()
        tables = await asyncio.gather(
            *(loop.run_in_executor(self.pool, read_piece, group, filesystem, columns) for group in groups)
        )
        node = ray.get_runtime_context().get_node_id()
        self.held[read] = [ray.put(table) for table in tables]
        return self.held[read], [(table.num_rows, table.nbytes) for table in tables], node

    def release(self, read: int) -> None:
        """Let go of the pieces of ``read``: tasks still gathering from them hold their own references."""
        self.held.pop(read, None)


def start_readers(where: dict) -> list[ray.actor.ActorHandle]:
    """A :class:`Reader` on each node where a step placed with ``where`` may run, with threads for its CPUs; where
    none is up yet (an autoscaling cluster), one that Ray places as ``where`` says."""
    nodes = placeable_nodes(where)
    if not nodes:
        return [Reader.options(**where).remote(READ_THREADS_PER_CPU)]
    return [
        Reader.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)).remote(
            max(1, round(READ_THREADS_PER_CPU * node["Resources"]["CPU"]))
        )
        for node in nodes
    ]


@dataclass(frozen=True, kw_only=True)
class Plan:
    """How a split streams: its row groups, what is read of them, its shuffle's seed (None: the stored order),
    how each epoch is cut (into ``windows`` windows, gathered by ``tasks`` tasks), and where it is read
    (``where``: the placement of the split's first step)."""

    groups: list[RowGroup]
    filesystem: pafs.FileSystem
    columns: list[str]
    seed: int | None
    windows: int
    tasks: int
    where: dict


@dataclass
class Stream:
    """A split's stream: the job's coordinator and the split's plan (what :func:`pipeline.data.pieces.dataset`
    reads)."""

    coordinator: ray.actor.ActorHandle
    split: str
    plan: Plan

    @property
    def windows(self) -> Windows:
        return Windows(self.plan.windows, self.plan.windows)

    @property
    def tasks(self) -> int:
        return self.plan.tasks

    def window(self, epoch: int, index: int, count: int) -> tuple[list[ray.ObjectRef], list[list]]:
        return ray.get(self.coordinator.window.remote(self.split, self.plan, epoch, index))

    @staticmethod
    def take(parts: dict[int, pa.Table], piece: np.ndarray, row: np.ndarray) -> dict[str, np.ndarray]:
        """The rows ``row[i]`` of pieces ``piece[i]``, in that order, as a numpy batch: only they are copied
        (each piece's rows taken from it alone: Arrow's take on many pieces at once copies them all first)."""
        grouped = np.argsort(piece, kind="stable")
        taken = [parts[int(p)].take(pa.array(row[grouped][piece[grouped] == p])) for p in np.unique(piece)]
        table = pa.concat_tables(taken, promote_options="permissive").combine_chunks()  # files may differ in types
        return numpy_batch(table.take(pa.array(np.argsort(grouped))))


def open_stream(
    coordinator: ray.actor.ActorHandle,
    split: str,
    groups: list[RowGroup],
    *,
    filesystem: pafs.FileSystem,
    columns: list[str],
    seed: int | None,
    budget: int,
    where: dict,
) -> Stream:
    """``split``'s stream from ``groups`` (its shuffle's ``seed``, None: the stored order), its windows sized to
    ``budget`` bytes, read where ``where`` places the split's first step, added to ``coordinator``, which reads
    its first window at once (while Ray Train starts)."""
    total = sum(group.bytes for group in groups)
    windows = max(1, min(len(groups), math.ceil(total / max(budget, 1))))
    tasks = max(windows, math.ceil(sum(group.rows for group in groups) / ROWS_PER_TASK))
    plan = Plan(
        groups=groups, filesystem=filesystem, columns=columns, seed=seed, windows=windows, tasks=tasks, where=where
    )
    coordinator.prefetch.remote(split, plan)
    return Stream(coordinator, split, plan)
