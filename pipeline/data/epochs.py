"""Each epoch of a split as Ray Data reads it (planned where Ray Data executes the dataset, run in its read tasks):
the split's parts (its parquet row groups, or the cache's pieces of them) in an order drawn anew every epoch, each
read task taking a few parts, their rows mixed together, numbered, and handed on in blocks of a batch's rows.

Ray Data plans a dataset's read tasks each time it executes it, and Ray Train's split executes the training split
once an epoch, once every worker has asked for it. The workers set the epoch on the job's :class:`Epochs` actor
before they ask (:mod:`pipeline.data.feed`), so the plan reads it: the parts' order, and which rows a resumed epoch
already trained on (left out). Each read task carries its epoch in its rows (``EPOCH``), so that a task Ray runs
again (a lost node's output, rebuilt from its lineage) makes the same rows with the same draws.

What this adds to ``read_parquet`` (whose operator, backpressure, placement and lineage it uses as they are): each
row's number in the split (the ledger's and the seeded draws' key: :mod:`transforms.randomness`), an order drawn
from the training epoch rather than from Ray's count of executions (a restarted worker group starts that count
again), and rows mixed across the few row groups a task reads.
"""

from __future__ import annotations

import math
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import ray
from ray.data import Datasource, ReadTask
from ray.data.block import Block, BlockAccessor, BlockMetadata

from pipeline.config import IngestConfig, TransformSpec
from pipeline.data.cache import Cache, Indexed
from pipeline.data.pieces import Batch, RowGroup, batch_bytes, group_order, read_group, trained
from transforms.randomness import EPOCH, ROW

READ_THREADS = 4  # a task reads up to this many parts at once (reading is mostly waiting on storage)


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)
class Epochs:
    """The job's epoch as the training workers read it, the rows of it trained on before a stop (a resumed epoch:
    packed bits, :mod:`pipeline.training.ledger`), and what the read tasks read (:class:`ReadCount`).

    Its process killed (the OOM killer's pick), Ray starts it again and retries the calls in flight: the workers set
    the epoch again before the next pass, and each read task carries its own; the read figures start over (the fault
    soak, tests/test_soak.py, failed the run before)."""

    def __init__(self) -> None:
        self.epoch, self.trained, self.read = 0, None, ReadCount()

    def set_epoch(self, epoch: int, done: np.ndarray | None = None) -> None:
        """The training workers, before each pass (Ray Train's split starts it once every worker has asked), each
        with the same ``done``: a pass leaves out only the rows its own workers say were trained (a restarted group
        that falls back to the epoch's start reads every row of it again)."""
        self.epoch, self.trained = epoch, None if done is None else ray.put(done)

    def position(self) -> tuple[int, ray.ObjectRef | None]:
        return self.epoch, self.trained

    def add_read(self, node: str, size: int, task: tuple) -> None:
        self.read.add(node, size, task)

    def reads(self) -> tuple[dict[str, int], int]:
        """Bytes read per node, and the read tasks run again."""
        return dict(self.read.by_node), self.read.again


class ReadCount:
    """What the read tasks read: bytes per node, and the tasks Ray ran again (a task seen twice in one execution of a
    split: rebuilt from its lineage). Only each split's newest ``EXECUTIONS`` executions are remembered, so a long run
    holds a few epochs' tasks, not every epoch's."""

    EXECUTIONS = 4  # a task of an older execution of its split is not run again once newer ones have begun

    def __init__(self) -> None:
        self.by_node: Counter = Counter()
        self.again = 0
        self.seen: dict[tuple[str, str], set[int]] = {}  # (split, execution) -> its tasks run, oldest first

    def add(self, node: str, size: int, task: tuple[str, str, int]) -> None:
        name, execution, index = task
        self.by_node[node] += size
        tasks = self.seen.setdefault((name, execution), set())
        self.again += index in tasks
        tasks.add(index)
        same = [key for key in self.seen if key[0] == name]
        for old in same[: -self.EXECUTIONS]:
            del self.seen[old]


@dataclass(frozen=True, kw_only=True)
class Reading:
    """How the training workers read each split (built on the driver, handed to every worker; read by
    :mod:`pipeline.data.feed`): the job's :class:`Epochs` actor, each split's steps the workers run on their device,
    the cached splits they read themselves (the others are Ray Train's shards of the job's datasets), the columns
    they keep, the ingest settings, and the seed and rows of the local shuffle."""

    epochs: Any
    on_device: dict[str, dict[str, TransformSpec]]
    indexed: dict[str, Indexed]
    columns: list[str]
    ingest: IngestConfig
    seed: int
    shuffle_rows: int | None = None  # each worker's shuffle buffer of the training split, rows (None: none)


@dataclass(frozen=True, kw_only=True)
class Parts:
    """A split's parts as its read tasks load them: per part its rows and bytes, and ``load(index)``, the part: a row
    group read from storage as an Arrow table, or the cache's pieces of it as a numpy batch."""

    rows: list[int]
    bytes: list[int]
    load: Callable[[int], pa.Table | Batch]


def stored_parts(groups: list[RowGroup], filesystem, columns: list[str]) -> Parts:
    """Parts that are the split's row ``groups``, their ``columns`` read from storage with their file (``path``)."""

    def load(index: int) -> pa.Table:
        table = read_group(groups[index], filesystem, columns)
        return table.append_column("path", pa.array([groups[index].file] * table.num_rows, pa.string()))

    return Parts(rows=[g.rows for g in groups], bytes=[g.bytes for g in groups], load=load)


class EpochSource(Datasource):
    """A split (its ``parts``) read anew every epoch: ``tasks`` read tasks, each a run of the epoch's order of the
    parts (drawn from ``seed`` and the epoch; None: the stored order), its rows mixed (seeded alike; not with ``mix``
    false, where the workers' shuffle buffers hold the whole split) and handed on in blocks of ``block_rows``; with
    ``numbers`` (the training split's: :func:`pipeline.data.pieces.row_numbers`) each row numbered (``ROW``) and those
    of a resumed epoch trained on before the stop left out; ``name``: the split's; ``epochs``: the job's
    :class:`Epochs`. ``keep``: where no step runs in Ray Data's tasks, the columns the read hands on (with ``ROW``),
    as stored, without the epoch's column."""

    def __init__(
        self,
        parts: Parts,
        *,
        name: str,
        epochs,
        seed: int | None,
        numbers: np.ndarray | None,
        tasks: int,
        block_rows: int,
        mix: bool = True,
        keep: list[str] | None = None,
    ):
        super().__init__()
        self.parts, self.name, self.epochs, self.seed, self.numbers = parts, name, epochs, seed, numbers
        self.tasks, self.block_rows = max(1, min(tasks, len(parts.rows))), block_rows
        self.mix, self.keep = mix and seed is not None, keep

    def estimate_inmemory_data_size(self) -> int:
        return sum(self.parts.bytes)

    def get_name(self) -> str:
        return "EpochSource"

    def get_read_tasks(self, parallelism: int, per_task_row_limit=None, data_context=None) -> list[ReadTask]:
        epoch, done = ray.get(self.epochs.position.remote())
        done = done if self.numbers is not None else None
        order = group_order(len(self.parts.rows), self.seed, epoch)
        execution = uuid.uuid4().hex  # a task that runs twice within one execution was run again by Ray
        tasks = []
        for index, run in enumerate(np.array_split(order, self.tasks)):
            meta = BlockMetadata(
                num_rows=sum(self.parts.rows[p] for p in run),
                size_bytes=sum(self.parts.bytes[p] for p in run),
                input_files=None,
                exec_stats=None,
            )
            read = self.read_task(run.tolist(), epoch=epoch, index=index, done=done, execution=execution)
            tasks.append(ReadTask(read, meta))
        return tasks

    def read_task(
        self, run: list[int], *, epoch: int, index: int, done: ray.ObjectRef | None, execution: str
    ) -> Callable:
        """Read task ``index`` of ``epoch`` (of the dataset's ``execution``): its ``run`` of parts, without the rows
        ``done`` (packed bits)."""
        parts, numbers, block_rows, epochs, seed = self.parts, self.numbers, self.block_rows, self.epochs, self.seed
        mix, keep, task = self.mix, self.keep, (self.name, execution, index)

        def read() -> Iterator[Block]:
            with ThreadPoolExecutor(min(len(run), READ_THREADS)) as pool:
                loaded = list(pool.map(parts.load, run))
            counts, sizes = zip(*map(measured, loaded))
            epochs.add_read.remote(ray.get_runtime_context().get_node_id(), sum(sizes), task)
            rows = np.arange(sum(counts))
            if mix:  # mixed before any row is left out: a resumed epoch keeps the order of the rest
                rows = rows[np.random.default_rng([seed, epoch, index]).permutation(len(rows))]
            extra = {}
            if numbers is not None:
                number = np.concatenate([numbers[p] + np.arange(n) for p, n in zip(run, counts)])
                if done is not None:
                    rows = rows[~trained(ray.get(done), number[rows])]
                extra[ROW] = number[rows]
            if keep is None:  # for the steps in the task after the read
                extra[EPOCH] = np.full(len(rows), epoch, np.int32)
            else:
                loaded = [kept(part, keep) for part in loaded]
            yield from blocks(loaded, rows, extra, block_rows)

        return read


def blocks(loaded: list, rows: np.ndarray, extra: dict[str, np.ndarray], block_rows: int) -> Iterator[Block]:
    """The ``rows`` (places among the ``loaded`` parts' rows, in order) with the ``extra`` columns, in blocks of
    ``block_rows``. Parts read from storage (Arrow): one take into the order (a take per block copies the whole table
    each time), none where the rows stay as read. The cache's pieces (numpy): numpy's indexing, and a frame Ray Data
    takes as it is (Arrow's take on images of different sizes spent seconds a block; numpy's moves pointers)."""
    if isinstance(loaded[0], pa.Table):
        table = pa.concat_tables(loaded, promote_options="permissive")  # files may differ in types
        if not np.array_equal(rows, np.arange(table.num_rows)):  # mixed, or rows left out: else as read, not copied
            table = table.take(pa.array(rows))
        for key, values in extra.items():
            table = table.append_column(key, pa.array(values))
        for start in range(0, table.num_rows, block_rows):
            yield table.slice(start, block_rows)
        return
    batch = {key: np.concatenate([part[key] for part in loaded])[rows] for key in loaded[0]} | extra
    for start in range(0, len(rows), block_rows):
        yield frame({key: values[start : start + block_rows] for key, values in batch.items()})


def kept(part: pa.Table | Batch, columns: list[str]) -> pa.Table | Batch:
    """A loaded part's ``columns`` alone."""
    return part.select(columns) if isinstance(part, pa.Table) else {name: part[name] for name in columns}


def measured(part: pa.Table | Batch) -> tuple[int, int]:
    """A loaded part's rows and bytes."""
    if isinstance(part, pa.Table):
        return part.num_rows, part.nbytes
    return len(next(iter(part.values()))), batch_bytes(part)


def frame(batch: Batch) -> Block:
    """A numpy batch as a block: Arrow (no copy of a fixed-shape array), or, where a column holds images of different
    sizes, a pandas frame holding them as they are (Arrow would copy them into one buffer)."""
    ragged = any(v.dtype == object and len(v) and isinstance(v[0], np.ndarray) for v in batch.values())
    if not ragged:
        return BlockAccessor.batch_to_block(batch)
    return pd.DataFrame({key: list(values) if values.ndim > 1 else values for key, values in batch.items()})


def epoch_tasks(parts: Parts, cpus: int, task_bytes: float) -> int:
    """Read tasks an epoch of ``parts`` takes: each holding about ``task_bytes`` of them at most, and at least as many
    as the preprocessing nodes have CPUs (fewer parts: a task each)."""
    return max(math.ceil(sum(parts.bytes) / task_bytes), cpus)


def cached_parts(built: Cache, groups: list[RowGroup], row_bytes: float) -> Parts:
    """Parts that are a cache's pieces of each of the split's row ``groups`` (``built``: the cache, ``row_bytes``: a
    cached row's estimated size), fetched from the object store as numpy batches."""

    def load(index: int) -> Batch:
        got = ray.get([built.pieces[i] for i in built.by_group[index]])
        return {key: np.concatenate([piece[key] for piece in got]) for key in got[0]}

    return Parts(rows=[g.rows for g in groups], bytes=[round(g.rows * row_bytes) for g in groups], load=load)
