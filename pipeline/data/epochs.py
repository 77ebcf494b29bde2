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
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import ray
from ray.data import Datasource, ReadTask
from ray.data.block import BlockAccessor, BlockMetadata

from pipeline.config import IngestConfig, TransformSpec
from pipeline.data.pieces import RowGroup, group_order, read_group, trained
from transforms.randomness import EPOCH, ROW

if TYPE_CHECKING:
    from pipeline.data.cache import Indexed

TASK_BYTES = 64 * 2**20  # a read task holds about this many bytes of its parts at once
READ_THREADS = 4  # a task reads up to this many parts at once (reading is mostly waiting on storage)


@ray.remote(num_cpus=0)
class Epochs:
    """The job's epoch as the training workers read it, the rows of it trained on before a stop (a resumed epoch:
    packed bits, :mod:`pipeline.training.ledger`), and the bytes each node read from storage."""

    def __init__(self) -> None:
        self.epoch, self.trained, self.read = 0, None, Counter()

    def set_epoch(self, epoch: int, done: np.ndarray | None = None) -> None:
        """The training workers, before each pass (Ray Train's split starts it once every worker has asked)."""
        if done is not None or epoch != self.epoch:
            self.trained = None if done is None else ray.put(done)
        self.epoch = epoch

    def position(self) -> tuple[int, ray.ObjectRef | None]:
        return self.epoch, self.trained

    def add_read(self, node: str, size: int) -> None:
        self.read[node] += size

    def reads(self) -> tuple[dict[str, int], dict[str, int]]:
        return dict(self.read), {}


@dataclass(frozen=True, kw_only=True)
class Reading:
    """How the training workers read each split (built on the driver, handed to every worker; read by
    :mod:`pipeline.data.feed`): the job's :class:`Epochs` actor, each split's steps the workers run on their device,
    the cached splits they read themselves (the others are Ray Train's shards of the job's datasets), the columns
    they keep, the ingest settings and the seed of the local shuffle."""

    epochs: Any
    on_device: dict[str, dict[str, TransformSpec]]
    indexed: dict[str, Indexed]
    columns: list[str]
    ingest: IngestConfig
    seed: int


@dataclass(frozen=True, kw_only=True)
class Parts:
    """A split's parts as its read tasks load them: per part its rows and bytes, and ``load(index)``, the part as an
    Arrow table (a row group read from storage, or the cache's pieces of it)."""

    rows: list[int]
    bytes: list[int]
    load: Callable[[int], pa.Table]


def row_groups(groups: list[RowGroup], filesystem, columns: list[str]) -> Parts:
    """Parts that are the split's row groups, read from storage with their file (``path``)."""

    def load(index: int) -> pa.Table:
        table = read_group(groups[index], filesystem, columns)
        return table.append_column("path", pa.array([groups[index].file] * table.num_rows, pa.string()))

    return Parts(rows=[g.rows for g in groups], bytes=[g.bytes for g in groups], load=load)


class EpochSource(Datasource):
    """A split (its ``parts``) read anew every epoch: ``tasks`` read tasks, each a run of the epoch's order of the
    parts (drawn from ``seed`` and the epoch; None: the stored order), its rows mixed (seeded alike) and handed on in
    blocks of ``block_rows``; with ``numbers`` (:func:`row_numbers`, the training split's) each row numbered
    (``ROW``) and those of a resumed epoch trained on before the stop left out; ``epochs``: the job's
    :class:`Epochs`."""

    def __init__(
        self, parts: Parts, *, epochs, seed: int | None, numbers: np.ndarray | None, tasks: int, block_rows: int
    ):
        super().__init__()
        self.parts, self.epochs, self.seed, self.numbers = parts, epochs, seed, numbers
        self.tasks, self.block_rows = max(1, min(tasks, len(parts.rows))), block_rows

    def estimate_inmemory_data_size(self) -> int:
        return sum(self.parts.bytes)

    def get_name(self) -> str:
        return "EpochSource"

    def get_read_tasks(self, parallelism: int, per_task_row_limit=None, data_context=None) -> list[ReadTask]:
        epoch, done = ray.get(self.epochs.position.remote())
        done = done if self.numbers is not None else None
        order = group_order(len(self.parts.rows), self.seed, epoch)
        tasks = []
        for index, run in enumerate(np.array_split(order, self.tasks)):
            meta = BlockMetadata(
                num_rows=sum(self.parts.rows[p] for p in run),
                size_bytes=sum(self.parts.bytes[p] for p in run),
                input_files=None,
                exec_stats=None,
            )
            read = self.read_task(run.tolist(), epoch=epoch, key=[self.seed, epoch, index], done=done)
            tasks.append(ReadTask(read, meta))
        return tasks

    def read_task(self, run: list[int], *, epoch: int, key: list, done: ray.ObjectRef | None) -> Callable:
        parts, numbers, block_rows, epochs = self.parts, self.numbers, self.block_rows, self.epochs
        mixed = self.seed is not None

        def read() -> Iterator[pa.Table]:
            with ThreadPoolExecutor(min(len(run), READ_THREADS)) as pool:
                tables = list(pool.map(parts.load, run))
            epochs.add_read.remote(ray.get_runtime_context().get_node_id(), sum(t.nbytes for t in tables))
            table = pa.concat_tables(tables, promote_options="permissive")  # files may differ in their types
            rows = np.arange(table.num_rows)
            if numbers is not None:
                number = np.concatenate([numbers[p] + np.arange(t.num_rows) for p, t in zip(run, tables)])
                table = table.append_column(ROW, pa.array(number))
                if done is not None:
                    rows = rows[~trained(ray.get(done), number)]
            if mixed:
                rows = rows[np.random.default_rng(key).permutation(len(rows))]
            table = table.take(pa.array(rows))  # one copy, in the epoch's order (a take per block copies all)
            table = table.append_column(EPOCH, pa.array(np.full(table.num_rows, epoch, np.int32)))
            for start in range(0, table.num_rows, block_rows):
                yield table.slice(start, block_rows)

        return read


def epoch_tasks(parts: Parts, cpus: int) -> int:
    """Read tasks an epoch of ``parts`` takes: each holding about ``TASK_BYTES`` of them at most, and at least as many
    as the preprocessing nodes have CPUs (fewer parts: a task each)."""
    return max(math.ceil(sum(parts.bytes) / TASK_BYTES), cpus)


def numpy_parts(pieces: list[list[ray.ObjectRef]], rows: list[int], sizes: list[int]) -> Parts:
    """Parts that are the cache's pieces of each row group (``pieces``), fetched from the object store."""

    def load(index: int) -> pa.Table:
        got = ray.get(pieces[index])
        batch = {key: np.concatenate([piece[key] for piece in got]) for key in got[0]}
        return BlockAccessor.batch_to_block(batch)

    return Parts(rows=rows, bytes=sizes, load=load)
