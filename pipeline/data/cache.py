"""The ingest cache (built from the driver, run in Ray tasks): a split's deterministic steps (decoding,
resizing to a working size) run once and their output stays in Ray's object store, so every epoch runs
only the random steps (crops, flips) on pixels already made.

The cache is :mod:`pipeline.data.pieces`: one task per parquet row group reads it and runs the steps that run once
(:func:`pipeline.data.steps.cached_steps`), returning the rows in pieces of at most ``PIECE_BYTES``. The
driver submits every task before training starts, in the order epoch 0 reads the row groups, and owns the
pieces: they outlive the tasks' processes (Ray rebuilds a lost one from its task) and a restarted worker
group finds them. On one node the training workers read it themselves (:func:`pipeline.data.pieces.shard`): epoch 0
from the pieces as they are built, a window of row groups after another (with enough row groups it never waits for
the whole cache), every later epoch one window of every row, a full shuffle. Elsewhere Ray Data's read tasks read the
pieces (:func:`pipeline.data.epochs.cached_parts`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import pyarrow.fs as pafs
import ray

from pipeline.data.pieces import (
    RowGroup,
    Sizes,
    Windows,
    batch_bytes,
    group_order,
    numpy_batch,
    read_group,
    window_groups,
)

PIECE_BYTES = 16 * 2**20  # a cached object's size at most (a row group bigger than this is cut up)
# Epoch 0 reads the cache as it is built, in up to this many windows of at least this many row groups each
# (a window's rows are mixed: a class-sorted split still gives batches of many classes)
FIRST_EPOCH_WINDOWS, WINDOW_GROUPS = 8, 8


@ray.remote
def build_pieces(group: RowGroup, filesystem: pafs.FileSystem, columns: list[str], prepare, pieces: int) -> tuple:
    """Read one row group, run ``prepare`` (the steps that run once) on it and return it in ``pieces``
    objects of about equal rows, then ``(rows, bytes)`` of each (what the driver reports)."""
    batch = prepare(numpy_batch(read_group(group, filesystem, columns), group.file))
    cuts = np.array_split(np.arange(len(batch["path"])), pieces)
    out = [
        {key: values[cut[0] : cut[-1] + 1] if len(cut) else values[:0] for key, values in batch.items()} for cut in cuts
    ]
    sizes = [(len(piece["path"]), batch_bytes(piece)) for piece in out]
    return (*out, sizes)


@dataclass(kw_only=True)
class Cache:
    """A split's cached pieces (owned by this process) and each row group's piece indices; built in the
    order epoch 0 reads the row groups (``seed``: the shuffle's)."""

    pieces: list[ray.ObjectRef]
    by_group: list[list[int]]  # row group -> indices into pieces
    sizes: list[ray.ObjectRef]  # per row group: [(rows, bytes)] of its pieces
    seed: int | None
    started: float  # time.perf_counter() when the tasks were submitted

    def figures(self) -> dict:
        """Rows, bytes and seconds from submission, once every piece exists (blocks until then; raises
        what a build task raised)."""
        sizes = [size for group in ray.get(self.sizes) for size in group]
        seconds = time.perf_counter() - self.started
        return {"rows": sum(rows for rows, _ in sizes), "bytes": sum(size for _, size in sizes), "seconds": seconds}

    @property
    def windows(self) -> Windows:
        return Windows(max(1, min(FIRST_EPOCH_WINDOWS, len(self.by_group) // WINDOW_GROUPS)), 1)

    def window(self, epoch: int, index: int, count: int) -> tuple[list[ray.ObjectRef], Sizes]:
        groups = window_groups(len(self.by_group), self.seed, epoch, count)[index]
        return [self.pieces[i] for g in groups for i in self.by_group[g]], ray.get([self.sizes[g] for g in groups])

    @staticmethod
    def take(parts: dict[int, dict[str, np.ndarray]], piece: np.ndarray, row: np.ndarray) -> dict[str, np.ndarray]:
        """The rows ``row[i]`` of pieces ``piece[i]``, in that order, as one batch."""
        first = next(iter(parts.values()))
        out = {key: np.empty((len(row), *values.shape[1:]), dtype=values.dtype) for key, values in first.items()}
        for index in np.unique(piece):
            where = piece == index
            for key, values in parts[int(index)].items():
                out[key][where] = values[row[where]]
        return out


@dataclass(frozen=True, kw_only=True)
class Indexed:
    """A cached split the training workers read themselves (:func:`pipeline.data.pieces.shard`), gathering each
    batch's rows from the cache's pieces as a DataLoader indexes what it holds: its cache, its ``rows``, and its row
    numbers (:func:`pipeline.data.pieces.row_numbers`; the training split's, else None)."""

    cache: Cache
    rows: int
    numbers: np.ndarray | None


def build(
    groups: list[RowGroup],
    filesystem: pafs.FileSystem,
    columns: list[str],
    *,
    prepare,
    row_bytes: float,
    seed: int | None,
    options: dict,
) -> Cache:
    """Submit one :func:`build_pieces` task per row group, in epoch 0's order, each cut into pieces of at most
    ``PIECE_BYTES`` by the estimated ``row_bytes``; returns at once, while Ray runs them."""
    pieces, by_group, sizes = [], [[] for _ in groups], [None] * len(groups)
    for g in group_order(len(groups), seed, 0):
        group = groups[g]
        count = max(1, math.ceil(group.rows * row_bytes / PIECE_BYTES))
        # SPREAD, as Ray Data's reads: over the nodes, and never into a Tune trial's placement group
        *refs, sizes[g] = build_pieces.options(num_returns=count + 1, scheduling_strategy="SPREAD", **options).remote(
            group, filesystem, columns, prepare, count
        )
        by_group[g] = list(range(len(pieces), len(pieces) + count))
        pieces += refs
    return Cache(pieces=pieces, by_group=by_group, sizes=sizes, seed=seed, started=time.perf_counter())
