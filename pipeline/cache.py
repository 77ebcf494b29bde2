"""The ingest cache (built from the driver, run in Ray tasks): a split's deterministic steps (decoding,
resizing to a working size) run once and their output stays in Ray's object store, so every epoch runs
only the random steps (crops, flips) on pixels already made.

The cache is a list of *pieces*, each one Ray object: one task per parquet row group reads it and runs
the steps that run once (:func:`pipeline.preprocess.cached_steps`), returning the rows in pieces of at
most ``PIECE_BYTES``. The driver submits every task before training starts, so the cache is built while
Ray Train starts its workers, and owns the pieces: they outlive the tasks' processes (Ray rebuilds a
lost one from its task) and a restarted worker group finds them.

The shuffle is a full one, new every epoch, without an all-to-all pass: each of the epoch's tasks takes
its share of a seeded permutation of every row and gathers those rows from the pieces, which Ray maps
from its shared memory without copying on one node (on a cluster, a node fetches the pieces it needs).
Any file layout, class-sorted included, is mixed as a DataLoader's index permutation mixes it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import ray
import ray.data

PIECE_BYTES = 16 * 2**20  # a cached object's size at most (a row group bigger than this is cut up)


@dataclass
class RowGroup:
    """One cache task's input: a row group of a parquet file, the first ``rows`` of it (``source.limit``)."""

    file: str
    index: int
    rows: int


def row_groups(files: list[str], filesystem: pafs.FileSystem, limit: int | None) -> list[RowGroup]:
    """The split's row groups in file order, from the footers, up to ``limit`` rows."""
    groups, left = [], math.inf if limit is None else limit
    for file in files:
        meta = pq.ParquetFile(file, filesystem=filesystem).metadata
        for index in range(meta.num_row_groups):
            rows = int(min(meta.row_group(index).num_rows, left))
            if rows <= 0:
                return groups
            groups.append(RowGroup(file, index, rows))
            left -= rows
    return groups


def numpy_batch(table: pa.Table, path: str) -> dict[str, np.ndarray]:
    """A table's columns as Ray Data hands a numpy batch to a step, plus the reader's ``path`` column."""
    batch = {name: table.column(name).to_numpy(zero_copy_only=False) for name in table.column_names}
    batch["path"] = np.full(table.num_rows, path, dtype=object)
    return batch


@ray.remote
def build_pieces(group: RowGroup, filesystem: pafs.FileSystem, columns: list[str], prepare, pieces: int) -> tuple:
    """Read one row group, run ``prepare`` (the steps that run once) on it and return it in ``pieces``
    objects of about equal rows, then ``(rows, bytes)`` of each (what the driver reports)."""
    reader = pq.ParquetFile(group.file, filesystem=filesystem)
    batch = prepare(numpy_batch(reader.read_row_group(group.index, columns=columns).slice(0, group.rows), group.file))
    cuts = np.array_split(np.arange(len(batch["path"])), pieces)
    out = [
        {key: values[cut[0] : cut[-1] + 1] if len(cut) else values[:0] for key, values in batch.items()} for cut in cuts
    ]
    return (*out, [(len(piece["path"]), batch_bytes(piece)) for piece in out])


def batch_bytes(batch: dict[str, np.ndarray]) -> int:
    """Bytes a batch's columns hold: arrays' buffers, and each element of object columns (ragged images, bytes)."""
    total = 0
    for values in batch.values():
        if values.dtype != object:
            total += values.nbytes
            continue
        for value in values:
            total += (
                value.nbytes if isinstance(value, np.ndarray) else len(value) if isinstance(value, (bytes, str)) else 8
            )
    return total


@dataclass
class Cache:
    """A split's cached pieces (owned by this process), in build order, and each row group's piece indices."""

    pieces: list[ray.ObjectRef]
    by_group: list[list[int]]  # row group -> indices into pieces
    sizes: list[ray.ObjectRef]  # per row group: [(rows, bytes)] of its pieces
    started: float  # time.perf_counter() when the tasks were submitted

    def built(self) -> dict:
        """Rows, bytes and seconds from submission, once every piece exists (blocks until then; raises
        what a build task raised)."""
        sizes = [size for group in ray.get(self.sizes) for size in group]
        seconds = time.perf_counter() - self.started
        return {"rows": sum(rows for rows, _ in sizes), "bytes": sum(size for _, size in sizes), "seconds": seconds}


def build(
    groups: list[RowGroup], filesystem: pafs.FileSystem, columns: list[str], prepare, row_bytes: float, options: dict
) -> Cache:
    """Submit one :func:`build_pieces` task per row group, each cut into pieces of at most ``PIECE_BYTES``
    by the estimated ``row_bytes``; returns at once, while Ray runs them."""
    pieces, by_group, sizes = [], [], []
    for group in groups:
        count = max(1, math.ceil(group.rows * row_bytes / PIECE_BYTES))
        # SPREAD, as Ray Data's reads: over the nodes, and never into a Tune trial's placement group
        *refs, size = build_pieces.options(num_returns=count + 1, scheduling_strategy="SPREAD", **options).remote(
            group, filesystem, columns, prepare, count
        )
        by_group.append(list(range(len(pieces), len(pieces) + count)))
        pieces, sizes = pieces + refs, [*sizes, size]
    return Cache(pieces, by_group, sizes, time.perf_counter())


PIECES_PER_TASK = 8  # an epoch's tasks each make about this many pieces' worth of rows


def epoch_rows(rows: list[int], tasks: int, seed: int | None, epoch: int) -> list[np.ndarray]:
    """Each task's share of the epoch, as indices into the pieces' rows laid end to end: a seeded
    permutation of every row for the epoch, cut into ``tasks`` equal runs (``seed`` None: the stored order)."""
    total = sum(rows)
    order = np.arange(total) if seed is None else np.random.default_rng([seed, epoch]).permutation(total)
    return np.array_split(order, tasks)


def dataset(cache: Cache, seed: int | None, then, seeded, options: dict) -> ray.data.Dataset:
    """A lazy dataset read from the cache each epoch, by a task per ``PIECES_PER_TASK`` pieces: with a
    ``seed``, a full shuffle of every row, new each epoch (each task gathers its share of the epoch's
    permutation from every piece: on one node Ray maps them without copying; it waits until the cache is
    built); without, the stored order. Rows leave a piece's worth at a time, through ``then(batch, epoch)``
    (the steps that run every epoch, in the same process: no copy between them). ``seeded`` binds the
    training epoch (:func:`pipeline.preprocess.seeded`); ``options``: where the tasks may run."""
    tasks = math.ceil(len(cache.pieces) / PIECES_PER_TASK)

    def cached(batch: dict[str, np.ndarray], epoch: int = 0) -> Iterator[dict[str, np.ndarray]]:
        task = int(batch["id"][0])
        rows = [0] * len(cache.pieces)
        for group, sizes in zip(cache.by_group, ray.get(cache.sizes)):
            for piece, (count, _) in zip(group, sizes):
                rows[piece] = count
        starts = np.cumsum([0, *rows])
        mine = epoch_rows(rows, tasks, seed, epoch)[task]
        if not len(mine):  # more tasks than rows (a transform skipped most of them)
            return
        piece_of = np.searchsorted(starts, mine, side="right") - 1
        needed = np.unique(piece_of)
        parts = dict(zip(needed.tolist(), ray.get([cache.pieces[i] for i in needed])))
        for cut in np.array_split(np.arange(len(mine)), max(1, min(len(needed), PIECES_PER_TASK))):
            yield then(gather(parts, piece_of[cut], mine[cut] - starts[piece_of[cut]]), epoch)

    return ray.data.range(tasks, override_num_blocks=tasks).map_batches(seeded(cached), batch_size=None, **options)


def gather(parts: dict[int, dict[str, np.ndarray]], piece: np.ndarray, row: np.ndarray) -> dict[str, np.ndarray]:
    """The rows ``row[i]`` of pieces ``piece[i]``, in that order, as one batch."""
    first = next(iter(parts.values()))
    out = {key: np.empty((len(row), *values.shape[1:]), dtype=values.dtype) for key, values in first.items()}
    for index in np.unique(piece):
        where = piece == index
        for key, values in parts[int(index)].items():
            out[key][where] = values[row[where]]
    return out
