"""A split read as row groups (planned on the driver, read in Ray tasks): each parquet file's row groups from its
footer (rows, bytes, the label's range), an epoch's seeded order of them, how much of the labels a run of them can
hold (:func:`mix`), and each row's number in the split, the key of the ledger and of each row's seeded draws.

The ingest cache (:mod:`pipeline.data.cache`) keeps each row group's prepared rows as *pieces*, Ray objects in the
object store; on one node the training workers read an epoch from them themselves (:func:`shard`): each window of
row groups in the epoch's seeded order, its rows mixed, dealt round the workers as a DistributedSampler deals a
permutation.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import ray

Batch = dict[str, np.ndarray]


@dataclass(kw_only=True)
class RowGroup:
    """A parquet file's row group, the first ``rows`` of it (``source.limit``)."""

    file: str
    index: int
    rows: int
    bytes: int  # uncompressed, from the footer: what reading it holds in memory
    labels: tuple | None = None  # the label column's (min, max) from the footer's statistics, where written


def row_groups(files: list[str], filesystem: pafs.FileSystem, limit: int | None, label: str) -> list[RowGroup]:
    """The split's row groups in file order, from the footers, up to ``limit`` rows, with the ``label`` column's
    range in each."""
    groups, left = [], math.inf if limit is None else limit
    for file in files:
        meta = pq.ParquetFile(file, filesystem=filesystem).metadata
        column = meta.schema.names.index(label) if label in meta.schema.names else None
        for index in range(meta.num_row_groups):
            group = meta.row_group(index)
            rows = int(min(group.num_rows, left))
            if rows <= 0:
                return groups
            size = round(group.total_byte_size * rows / max(group.num_rows, 1))
            groups.append(RowGroup(file=file, index=index, rows=rows, bytes=size, labels=label_range(group, column)))
            left -= rows
    return groups


def label_range(group: pq.RowGroupMetaData, column: int | None) -> tuple | None:
    """A row group's label (min, max), as its footer's statistics say (None where they are not written)."""
    stats = group.column(column).statistics if column is not None else None
    return (stats.min, stats.max) if stats is not None and stats.has_min_max else None


def read_group(group: RowGroup, filesystem: pafs.FileSystem, columns: list[str]) -> pa.Table:
    """One row group's ``columns`` (its first ``group.rows`` rows)."""
    reader = pq.ParquetFile(group.file, filesystem=filesystem)
    return reader.read_row_group(group.index, columns=columns).slice(0, group.rows)


def numpy_batch(table: pa.Table, path: str | None = None) -> Batch:
    """A table's columns as Ray Data hands a numpy batch to a step, with the reader's ``path`` column (the
    table's own, or ``path`` for every row)."""
    batch = {name: table.column(name).to_numpy(zero_copy_only=False) for name in table.column_names}
    if path is not None:
        batch["path"] = np.full(table.num_rows, path, dtype=object)
    return batch


def batch_bytes(batch: Batch) -> int:
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


def group_order(groups: int, seed: int | None, epoch: int) -> np.ndarray:
    """An epoch's order of the row groups: drawn from (seed, epoch); the stored order without a seed."""
    return np.arange(groups) if seed is None else np.random.default_rng([seed, epoch]).permutation(groups)


def window_groups(groups: int, seed: int | None, epoch: int, windows: int) -> list[np.ndarray]:
    """The row groups of each of the epoch's ``windows``: its order cut into runs of about equal length."""
    return np.array_split(group_order(groups, seed, epoch), windows)


def mix(groups: list[RowGroup], windows: int, seed: int | None, values: list | None) -> float | None:
    """How much of a split's labels a window can hold, against a full shuffle's 1.0: over epoch 0's ``windows``
    (drawn with ``seed``), the mean share of the labels the window's row groups' label ranges cover.
    ``values``: a classification's labels (covered ones counted); None: a number (the range's covered length).
    A split stored in random order covers all of them in every row group; one stored by label, few. None
    when a footer has no label range (the writer left statistics out)."""
    ranges = [group.labels for group in groups]
    if not ranges or any(r is None for r in ranges):
        return None
    low, high = min(r[0] for r in ranges), max(r[1] for r in ranges)
    shares = []
    for window in window_groups(len(groups), seed, 0, windows):
        held = sorted(ranges[g] for g in window)
        if values is not None:
            shares.append(sum(any(a <= v <= b for a, b in held) for v in values) / len(values))
            continue
        covered, reach = 0.0, low
        for a, b in held:  # the union's length, the ranges in order of their start
            covered += max(0.0, b - max(a, reach))
            reach = max(reach, b)
        shares.append(covered / (high - low) if high > low else 1.0)
    return float(np.mean(shares))


Sizes = list[list[tuple[int, int]]]  # per row group, its pieces' (rows, bytes)


class Source(Protocol):
    """Where an epoch's windows of pieces are (the cache's: :class:`pipeline.data.cache.Cache`)."""

    def window(self, epoch: int, index: int, count: int) -> tuple[list[ray.ObjectRef], Sizes]:
        """Window ``index`` of the ``count`` the epoch has: its pieces, in the window's row-group order, and per row
        group its pieces' ``[(rows, bytes)]`` (waits until they are built)."""


@dataclass(frozen=True)
class Windows:
    """How many windows an epoch's row groups are cut into: ``first`` in epoch 0, ``later`` after it."""

    first: int
    later: int

    def count(self, epoch: int) -> int:
        return self.first if epoch == 0 else self.later


def row_numbers(groups: list[RowGroup]) -> np.ndarray:
    """Each row group's first row number in the split (file order), then the split's rows: a row's number is
    its group's first plus its place in the group, whatever order an epoch reads them in."""
    return np.cumsum([0, *(group.rows for group in groups)])


def trained(bits: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Whether each of ``rows`` (row numbers) is set in ``bits`` (packed, as :func:`numpy.packbits` packs)."""
    return (bits[rows >> 3] >> (7 - (rows & 7)).astype(np.uint8)) & 1 == 1


@dataclass(frozen=True, kw_only=True)
class WindowRows:
    """One window of an epoch as its rows are read: its pieces (``refs``), where each piece's rows start among the
    window's (``starts``), the window's seeded ``order`` of its rows, and each row's number in the split (``numbers``,
    by its place in the window; None: the split is not numbered)."""

    refs: list[ray.ObjectRef]
    starts: np.ndarray
    order: np.ndarray
    numbers: np.ndarray | None

    def where(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The piece (an index into ``refs``) of each of ``rows`` (places in the window) and its place in the piece."""
        piece = np.searchsorted(self.starts, rows, side="right") - 1
        return piece, rows - self.starts[piece]

    def untrained(self, rows: np.ndarray, done: np.ndarray | None) -> np.ndarray:
        """``rows`` without those trained on before a stop (``done``: the epoch's packed bits)."""
        return rows if done is None or self.numbers is None else rows[~trained(done, self.numbers[rows])]


def window_rows(
    source: Source, epoch: int, window: int, count: int, seed: int | None, numbers: np.ndarray | None
) -> WindowRows:
    """Window ``window`` of the ``count`` of ``epoch`` (waits until its pieces are built), its rows in the order drawn
    from (``seed``, epoch, window), numbered from ``numbers`` (:func:`row_numbers`) when given."""
    refs, sizes = source.window(epoch, window, count)
    starts = np.cumsum([0, *(n for group in sizes for n, _ in group)])
    total = int(starts[-1])
    key = None if seed is None else [seed, epoch, window]
    order = np.arange(total) if key is None else np.random.default_rng(key).permutation(total)
    number = None
    if numbers is not None:  # each row's number: its row group's first, plus its place in the group
        groups = window_groups(len(numbers) - 1, seed, epoch, count)[window]
        held = [sum(n for n, _ in group) for group in sizes]
        number = np.concatenate([numbers[g] + np.arange(n) for g, n in zip(groups, held)] or [np.zeros(0, int)])
    return WindowRows(refs=refs, starts=starts, order=order, numbers=number)


def shard(
    source: Source,
    windows: Windows,
    epoch: int,
    *,
    seed: int | None,
    numbers: np.ndarray | None,
    done: np.ndarray | None,
    rank: int,
    world: int,
    rows: int,
) -> Iterator[tuple[WindowRows, np.ndarray]]:
    """Worker ``rank`` of ``world``'s share of ``epoch``, read from ``source`` by the worker itself (a cache on its
    node): each window's rows in the epoch's order, those trained on before a stop (``done``) left out, dealt round
    the workers in turn as a DistributedSampler deals a permutation, so every worker moves through the windows
    together (epoch 0 reads the cache as it is built). ``rows``: the epoch's rows left; each worker takes
    ``rows // world`` of them, the rest none (Ray Train's equal split drops them too). Yields each window with the
    places of this worker's rows in it."""
    share, seen, taken, count = rows // world, 0, 0, windows.count(epoch)
    for window in range(count):
        if taken >= share:
            return
        read = window_rows(source, epoch, window, count, seed, numbers)
        order = read.untrained(read.order, done)
        mine = order[(rank - seen) % world :: world][: share - taken]
        seen, taken = seen + len(order), taken + len(mine)
        if len(mine):
            yield read, mine
