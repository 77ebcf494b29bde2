"""A split read as *pieces* and each epoch gathered from them (built on the driver, run in Ray tasks): the
mechanism under both the ingest cache (:mod:`pipeline.data.cache`: pieces decoded once and kept for the run) and
the streamed shuffle (:mod:`pipeline.data.stream`: pieces of raw rows read anew each epoch, a window at a time).

A piece is one Ray object: a parquet row group, or part of one, as read (and, for the cache, prepared), in the
object store of the node whose task made it. An epoch puts the row groups in a seeded order and cuts that order
into *windows*; the epoch's tasks, a run of consecutive ones per window, each take an equal share of it and
gather those rows from the window's pieces (Ray maps them from the node's shared memory without copying).

On a cluster the pieces of a window sit on the nodes that read or built them, its *homes*. Each home's rows are
mixed by a seeded permutation of their own and cut into *parts*, as many as its share of the window's tasks; a
task claims a part from the job's coordinator (:meth:`pipeline.data.coordinator.Coordinator.claim`), one of its
own node's first, so that its node fetches nothing: no window crosses the network, and each node holds its own
share. A task takes another node's part only when its own node's are all taken, and has that part's rows gathered
on the node that holds it (:func:`gather_there`): only the rows it needs cross the network. Each row is still
gathered once an epoch, whichever task claims it; the mix comes from which row groups each node reads (a new draw
every epoch), as MosaicML Streaming assigns shards to nodes and shuffles within them. On one node, the window is
one home: its rows mixed together. There is no all-to-all pass: a window's rows leave as soon as its pieces exist,
and a window that holds every row is a DataLoader's full shuffle. Without a seed, the stored order. A row mixes
only with its own window's home: how well that mixes a split is :func:`mix`'s.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import ray
import ray.data
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from pipeline.common import workarounds
from transforms.randomness import ROW  # the training split's row numbers: the ledger's count, the draws' key

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
    """Where an epoch's tasks find a window's pieces (the cache's, or a stream's reads)."""

    def window(self, epoch: int, index: int, count: int) -> tuple[list[ray.ObjectRef], Sizes, list[str | None]]:
        """Window ``index`` of the ``count`` the epoch has: its pieces, in the window's row-group order, per row
        group its pieces' ``[(rows, bytes)]`` and the node that holds them (waits until they are read)."""

    def take(self, parts: dict[int, object], piece: np.ndarray, row: np.ndarray) -> Batch:
        """The rows ``row[i]`` of pieces ``piece[i]`` (``parts``: piece index -> piece), in that order, as a batch."""


@dataclass(frozen=True)
class Windows:
    """How many windows an epoch's row groups are cut into: ``first`` in epoch 0, ``later`` after it."""

    first: int
    later: int

    def count(self, epoch: int) -> int:
        return self.first if epoch == 0 else self.later


def window_tasks(window: int, tasks: int, windows: int) -> range:
    """The epoch's ``tasks`` that read window ``window`` of ``windows``: a run of consecutive ones
    (``tasks >= windows``)."""
    return range(-(-window * tasks // windows), -(-(window + 1) * tasks // windows))


def task_share(task: int, tasks: int, windows: int) -> tuple[int, int, int]:
    """Which window task ``task`` of ``tasks`` reads, and which of that window's tasks it is, of how many."""
    window = task * windows // tasks
    run = window_tasks(window, tasks, windows)
    return window, task - run.start, len(run)


CHUNKS_PER_TASK = 8  # a task hands on its rows in about this many batches (fewer, with fewer pieces)


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
    by its place in the window; None: the split is not numbered); each piece's bytes and its home (the node that
    holds it), and the draw that mixes a home's rows (``key``: seed, epoch, window; None: the stored order)."""

    refs: list[ray.ObjectRef]
    starts: np.ndarray
    order: np.ndarray
    numbers: np.ndarray | None
    piece_bytes: np.ndarray
    piece_homes: list[str | None]
    key: list[int] | None

    def homes(self) -> list[str | None]:
        """The nodes that hold the window's pieces, in the window's order (one None: where is not known)."""
        return list(dict.fromkeys(self.piece_homes))

    def parts(self, tasks: int) -> list[tuple[int, int, int]]:
        """The window's ``tasks`` parts, each (home, index among the home's parts, the home's parts): each home
        at least one, the rest by its rows; with fewer tasks than homes, one home of every piece."""
        homes = self.homes()
        if tasks < len(homes):
            return [(0, part, tasks) for part in range(tasks)]
        rows = np.diff(self.starts)
        held = np.array([rows[[h == home for h in self.piece_homes]].sum() for home in homes], dtype=float)
        wanted = (tasks - len(homes)) * held / held.sum() if held.sum() else np.zeros(len(homes))
        counts = 1 + np.floor(wanted).astype(int)
        counts[np.argsort(np.floor(wanted) - wanted)[: tasks - counts.sum()]] += 1  # the largest remainders
        return [(home, part, int(n)) for home, n in enumerate(counts) for part in range(n)]

    def part(self, home: int, index: int, parts: int, homes: int) -> np.ndarray:
        """Part ``index`` of the ``parts`` of ``home`` (of ``homes``), as places in the window: that home's rows,
        mixed among themselves (one home: the window's ``order``)."""
        if homes <= 1:
            return np.array_split(self.order, parts)[index]
        name = self.homes()[home]
        pieces_there = np.flatnonzero([h == name for h in self.piece_homes])
        places = np.concatenate([np.arange(self.starts[i], self.starts[i + 1]) for i in pieces_there])
        if self.key is not None:
            places = places[np.random.default_rng([*self.key, home]).permutation(len(places))]
        return np.array_split(places, parts)[index]

    def where(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The piece (an index into ``refs``) of each of ``rows`` (places in the window) and its place in the piece."""
        piece = np.searchsorted(self.starts, rows, side="right") - 1
        return piece, rows - self.starts[piece]

    def untrained(self, rows: np.ndarray, done: np.ndarray | None) -> np.ndarray:
        """``rows`` without those trained on before a stop (``done``: the epoch's packed bits)."""
        return rows if done is None or self.numbers is None else rows[~trained(done, self.numbers[rows])]


def claim(claimed: dict[int, int], task: int, node: str, homes: list[str]) -> int:
    """The part a window's gathering task ``task`` (its index among the window's tasks) takes, running on ``node``;
    ``homes``: each part's node; ``claimed``: the window's task -> part so far (updated). Its own part where that is
    held on its node, else another part held there, else its own, else one of the node with the most parts left:
    every part once, on a task's own node while one is left there. A task asking again (Ray retried it) gets its
    part again, and so gathers the same rows."""
    if task not in claimed:
        taken = set(claimed.values())
        free = [part for part in range(len(homes)) if part not in taken]
        here = [part for part in free if homes[part] == node]
        if task in here or (not here and task in free):
            claimed[task] = task
        elif here:
            claimed[task] = here[-1]  # from the end: the tasks whose own parts these are may still come
        else:
            fullest = Counter(homes[part] for part in free).most_common(1)[0][0]
            claimed[task] = max(part for part in free if homes[part] == fullest)
    return claimed[task]


def window_rows(
    source: Source, epoch: int, window: int, count: int, seed: int | None, numbers: np.ndarray | None
) -> WindowRows:
    """Window ``window`` of the ``count`` of ``epoch`` (waits until its pieces are read or built), its rows in the
    order drawn from (``seed``, epoch, window), numbered from ``numbers`` (:func:`row_numbers`) when given."""
    refs, sizes, homes = source.window(epoch, window, count)
    starts = np.cumsum([0, *(n for group in sizes for n, _ in group)])
    total = int(starts[-1])
    key = None if seed is None else [seed, epoch, window]
    order = np.arange(total) if key is None else np.random.default_rng(key).permutation(total)
    number = None
    if numbers is not None:  # each row's number: its row group's first, plus its place in the group
        groups = window_groups(len(numbers) - 1, seed, epoch, count)[window]
        held = [sum(n for n, _ in group) for group in sizes]
        number = np.concatenate([numbers[g] + np.arange(n) for g, n in zip(groups, held)] or [np.zeros(0, int)])
    piece_bytes = np.array([size for group in sizes for _, size in group], dtype=np.int64)
    piece_homes = [home for group, home in zip(sizes, homes) for _ in group]
    return WindowRows(
        refs=refs, starts=starts, order=order, numbers=number, piece_bytes=piece_bytes, piece_homes=piece_homes, key=key
    )


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


@ray.remote(num_cpus=0)
def gather_there(take: Callable, refs: dict[int, ray.ObjectRef], piece: np.ndarray, row: np.ndarray) -> Batch:
    """The rows ``row[i]`` of pieces ``piece[i]`` (``refs``: piece index -> its ref), gathered with ``take`` on the
    node that holds the pieces, for a task on another node that claimed a part of them: only the rows cross the
    network, not the pieces they are taken from."""
    return take(dict(zip(refs, ray.get(list(refs.values())))), piece, row)


def dataset(
    source: Source,
    windows: Windows,
    tasks: int,
    *,
    name: str,
    seed: int | None,
    then: Callable,
    coordinator,
    options: dict,
    numbers: np.ndarray | None = None,
) -> ray.data.Dataset:
    """A lazy dataset of ``tasks`` tasks per epoch that gather each epoch's rows from ``source``'s pieces (split
    ``name``'s), a window at a time, mixed with ``seed``, and hand them on through ``then(batch, epoch)`` (the steps
    that run every epoch, in the same process: no copy between them). Each task asks ``coordinator``
    (:class:`pipeline.data.coordinator.Coordinator`) for the training epoch once and, on a cluster, claims a part of
    its window, one held on its own node where one is left; ``options``: the tasks' Ray options (CPUs, where they
    may run). With ``numbers`` (:func:`row_numbers`), each row carries its number (``ROW``), and the rows of a
    resumed epoch trained on before the stop are left out, the rest keeping their places in the epoch's order."""
    tasks = max(tasks, windows.first, windows.later)

    def epoch_part(batch: Batch) -> Iterator[Batch]:
        epoch, done = ray.get(coordinator.position.remote())
        count = windows.count(epoch)
        window, part, parts = task_share(int(batch["id"][0]), tasks, count)
        rows = window_rows(source, epoch, window, count, seed, numbers)
        plan, node = rows.parts(parts), ray.get_runtime_context().get_node_id()
        homes = len({home for home, _, _ in plan})
        if homes > 1:  # a part held on this node, where one is left
            held = [rows.homes()[home] for home, _, _ in plan]
            part = ray.get(coordinator.claim.remote((name, epoch, window), part, node, held))
        mine = rows.part(*plan[part], homes)
        mine = rows.untrained(mine, None if done is None else ray.get(done))
        if not len(mine):  # more tasks than rows (a transform skipped most of them), or all trained on
            return
        piece_of, place = rows.where(mine)
        needed = np.unique(piece_of)
        home = rows.homes()[plan[part][0]] if homes > 1 else None
        if home not in (node, None):  # another node's part: its rows gathered there, only they cross the network
            there = {i: rows.refs[i] for i in needed.tolist()}
            away = gather_there.options(scheduling_strategy=NodeAffinitySchedulingStrategy(home, soft=True))
            gathered = ray.get(away.remote(source.take, there, piece_of, place))
            coordinator.received.remote(node, batch_bytes(gathered))
            cuts = np.array_split(np.arange(len(mine)), CHUNKS_PER_TASK)
            taken = ({key: values[cut] for key, values in gathered.items()} for cut in cuts)
        else:
            fetched = sum(int(rows.piece_bytes[i]) for i in needed if rows.piece_homes[i] not in (node, None))
            if fetched:  # a window of fewer tasks than nodes: its pieces from everywhere
                coordinator.received.remote(node, fetched)
            found = dict(zip(needed.tolist(), ray.get([rows.refs[i] for i in needed])))
            cuts = np.array_split(np.arange(len(mine)), max(1, min(len(needed), CHUNKS_PER_TASK)))
            taken = (source.take(found, piece_of[cut], place[cut]) for cut in cuts)
        for cut, rows_cut in zip(cuts, taken):
            if rows.numbers is not None:
                rows_cut[ROW] = rows.numbers[mine[cut]]
            yield then(rows_cut, epoch)

    ds = ray.data.range(tasks, override_num_blocks=tasks).map_batches(epoch_part, batch_size=None, **options)
    return workarounds.streamed_blocks(ds)
