"""Streamed splits (planned on the driver; reader actors and the gathering tasks run them): a split that is not
cached (``ingest.cache`` false, too large for the object store, or one epoch) read anew every epoch, the
training split in a new seeded order without an all-to-all pass, validation in its stored order.

Each epoch is :mod:`pipeline.data.pieces`' windows of raw rows. A window's row groups are read by the job's
:class:`Reader` actors, one on each node alive that may run the split's first step (its resources and labels), an
equal share each, in threads: each row group lands in the object store of the node that read it, as Arrow columns
(no copy when a task maps them), reads grow with the preprocessing nodes and their CPUs, and the epoch's tasks
gather from the pieces on their own node. The job's :class:`pipeline.data.coordinator.Coordinator` calls the
readers, so it owns the pieces and keeps their refs, never the bytes: a lost node's pieces are read again by Ray
(the calls' lineage) on the nodes left. Every step
then runs in the tasks that gather the window's rows, decoding included.

A window holds what fits a third of ``ingest.cache_share`` of the preprocessing nodes' object stores
(this one, the next, and the last one's stragglers): a split that fits is one window, a full shuffle every
epoch; a larger one is mixed within windows of row groups drawn at random from all of it.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import ray

from pipeline.common import workarounds
from pipeline.data.pieces import RowGroup, Windows, numpy_batch, read_group
from pipeline.runtime.cluster import placeable_nodes

ROWS_PER_TASK = 1000  # an epoch's tasks each gather about this many rows
READ_THREADS_PER_CPU = 2  # row groups a reader reads at once per CPU of its node (Arrow releases the GIL)


def read_piece(group: RowGroup, filesystem: pafs.FileSystem, columns: list[str]) -> pa.Table:
    """One row group's ``columns`` and its file (``path``), as read."""
    table = read_group(group, filesystem, columns)
    return table.append_column("path", pa.array([group.file] * table.num_rows, pa.string()))


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)
class Reader:
    """Reads row groups on its node, in threads (reading is mostly waiting on storage; Arrow releases the GIL),
    into that node's object store; one per preprocessing node of a job, started by its coordinator. Its own process
    rather than tasks: a run started 39 worker processes with read tasks, 19 with readers (a gathering task that
    waits for its window releases its CPU, and a read task then takes a new process). What it reads are its
    calls' returns, owned by the coordinator that called: when their node is lost, Ray restarts the reader on
    another node and calls it again (lineage reconstruction of actor tasks, ``max_restarts``/``max_task_retries``)."""

    def __init__(self, threads: int) -> None:
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="read")

    def read(self, groups: list[RowGroup], filesystem: pafs.FileSystem, columns: list[str]) -> tuple:
        """``groups`` read at once, each returned as its own object, then their ``(rows, bytes)`` and this node's
        id (call with ``num_returns=len(groups) + 1``)."""
        tables = list(self.pool.map(lambda group: read_piece(group, filesystem, columns), groups))
        node = ray.get_runtime_context().get_node_id()
        return (*tables, ([(table.num_rows, table.nbytes) for table in tables], node))


def read_window(
    groups: list[RowGroup], filesystem: pafs.FileSystem, columns: list[str], where: dict, readers: dict
) -> list:
    """A window's row groups read by the :class:`Reader` of each node alive where a step placed with ``where`` may
    run, an equal share each; ``readers``: node id -> its reader, the job's, a reader started for a node that has
    none (one that joined reads from the next window on), kept while the job runs (a lost node's reader restarts
    elsewhere, to read again what Ray lost with it). Where no such node is up yet (an autoscaling cluster), one
    reader that Ray places as ``where`` says. Per share: the refs of its pieces, then of their sizes."""
    nodes = placeable_nodes(where) or [{"NodeID": None, "Resources": {"CPU": 1}}]
    for node in nodes:
        if node["NodeID"] not in readers:
            fallback = where.get("label_selector", {})
            placed = workarounds.on_node_else(node["NodeID"], fallback) if node["NodeID"] else where
            threads = max(1, round(READ_THREADS_PER_CPU * node["Resources"]["CPU"]))
            readers[node["NodeID"]] = Reader.options(**placed).remote(threads)
    shares = [list(share) for share in np.array_split(np.array(groups, dtype=object), len(nodes)) if len(share)]
    return [
        readers[node["NodeID"]].read.options(num_returns=len(share) + 1).remote(share, filesystem, columns)
        for node, share in zip(nodes, shares)
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

    def window(self, epoch: int, index: int, count: int) -> tuple[list[ray.ObjectRef], list[list], list[str]]:
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
    ``budget`` bytes, read where ``where`` places the split's first step, gathered by tasks of about
    ``ROWS_PER_TASK`` rows (at least one per window and node), added to ``coordinator``, which reads its first
    window at once (while Ray Train starts)."""
    total = sum(group.bytes for group in groups)
    windows = max(1, min(len(groups), math.ceil(total / max(budget, 1))))
    nodes = max(1, len(placeable_nodes(where)))  # each window cut into parts on every node that reads it
    tasks = max(windows * nodes, math.ceil(sum(group.rows for group in groups) / ROWS_PER_TASK))
    plan = Plan(
        groups=groups, filesystem=filesystem, columns=columns, seed=seed, windows=windows, tasks=tasks, where=where
    )
    coordinator.prefetch.remote(split, plan)
    return Stream(coordinator, split, plan)
