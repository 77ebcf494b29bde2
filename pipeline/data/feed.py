"""Runs in every training worker, its one door to the data layer (:class:`Feed`, read as the driver's
:class:`Reading` says): each split's shard of an epoch as batches on the training device, the split's device steps
applied (:mod:`transforms.device`: the steps that run every epoch, on a GPU when the workers have one; which ones is
the driver's :func:`pipeline.data.steps.device_split`).

Batches come one of two ways:

- From Ray Data's ``iter_torch_batches`` (a streamed split, or a cached one with steps to run in Ray Data's tasks or
  spread over nodes), collated in its threads while the worker trains: without device steps by Ray's own collate and
  transfer, in pinned memory on a GPU.
- Read by the worker itself (a cached split with nothing to run in Ray Data's tasks, on a one-node runtime:
  :class:`pipeline.data.cache.Indexed`): the worker deals itself its share of the epoch's order
  (:func:`pipeline.data.pieces.shard`, as a DistributedSampler does) and gathers each batch's rows from the cache's
  pieces, mapped from the node's shared memory: one copy a row, no task, no split coordinator, no call per batch,
  as a DataLoader indexing what it holds in memory.

Either way :class:`Collate` plans each device step's draws on the CPU (per row: its window, its flip) and turns the
columns into tensors, ragged pixels padded into one pinned tensor (:class:`transforms.device.Ragged`) and encoded
images left as they are; the batch then moves to the device (``non_blocking``) and the steps run there, so what
reaches the worker is what the cache holds (or a streamed split's encoded bytes), not the cropped pixels. That work
runs in ``ingest.prefetch_batches`` threads ahead of the training step (:func:`ahead`), as a DataLoader's workers.
"""

from __future__ import annotations

import collections
import queue
import threading
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray
import ray.train
import torch
from ray.data.collate_fn import NumpyBatchCollateFn

from pipeline.data import pieces
from pipeline.data.cache import Cache, Indexed
from pipeline.data.epochs import Reading  # what the driver hands the workers, with Feed their door
from pipeline.data.steps import device_form, device_params
from transforms.device import Ragged
from transforms.randomness import ROW


@dataclass(frozen=True)
class Collated:
    """A batch as :class:`Collate` leaves it (not a tensor batch, so Ray Data hands it over as it is): its columns,
    and each device step's planned draws."""

    batch: dict[str, Any]
    params: list[dict[str, np.ndarray]]


class Collate(NumpyBatchCollateFn):
    """Off the training thread: each device step's draws planned for the batch (``epoch``'s), then its columns as
    tensors, pinned for a GPU: ragged pixels padded into one tensor for a GPU (left as they are for the CPU), encoded
    images left for the device step that decodes them."""

    def __init__(self, steps: list, epoch: int, device: torch.device):
        super().__init__()
        self.steps, self.epoch = steps, epoch
        self.pad = self.pin = device.type == "cuda"  # one tensor a column, in pinned memory, for a GPU

    def __call__(self, batch: dict[str, np.ndarray]) -> Collated:
        params = [step.plan(batch, self.epoch) for step in self.steps]
        return Collated({name: self.tensor(values) for name, values in batch.items()}, params)

    def tensor(self, values: np.ndarray) -> Any:
        if values.dtype != object:
            with warnings.catch_warnings():  # pixels from Ray's object store are read-only; nothing writes to them
                warnings.filterwarnings("ignore", "The given NumPy array is not writable", UserWarning)
                tensor = torch.from_numpy(values)
            return tensor.pin_memory() if self.pin else tensor
        if len(values) and all(isinstance(value, np.ndarray) for value in values):
            return self.ragged(values)
        return values  # encoded images: the device step that takes them decodes them

    def ragged(self, images: np.ndarray) -> Ragged:
        """Images of different sizes (C, H, W): for a GPU at the top left of one pinned uint8 tensor (N, C, H, W),
        for the CPU as they are."""
        sizes = np.array([image.shape[1:] for image in images], dtype=np.int64)
        if not self.pad:
            with warnings.catch_warnings():  # read-only pixels from Ray's object store: the steps only read them
                warnings.filterwarnings("ignore", "The given NumPy array is not writable", UserWarning)
                return Ragged([torch.from_numpy(image) for image in images], torch.from_numpy(sizes))
        channels, (height, width) = images[0].shape[0], sizes.max(axis=0)
        padded = torch.zeros((len(images), channels, height, width), dtype=torch.uint8, pin_memory=self.pin)
        target = padded.numpy()
        for i, image in enumerate(images):
            target[i, :, : image.shape[1], : image.shape[2]] = image
        return Ragged(padded, torch.from_numpy(sizes))


class Feed:
    """A training worker's door to the data layer: its share of each split's epoch as batches on its ``device``, as
    the driver's ``reading`` says (:class:`pipeline.data.epochs.Reading`), each split's device steps built once here."""

    def __init__(self, reading: Reading, device: torch.device):
        self.reading, self.device = reading, device
        self.steps = {
            split: [device_form(spec)(**device_params(spec)) for spec in steps.values()]
            for split, steps in reading.on_device.items()
        }

    def train(self, *, epoch: int, rank: int, world: int, trained: np.ndarray | None = None) -> Iterator[dict]:
        """Worker ``rank`` of ``world``'s share of the training split's ``epoch``, without the rows ``trained`` on
        before a stop. The epoch is set on the job's :class:`pipeline.data.epochs.Epochs` first: Ray Data plans the
        epoch's reads from it once every worker has asked (Ray Train's split)."""
        ray.get(self.reading.epochs.set_epoch.remote(epoch, trained))
        return self.batches("train", epoch=epoch, rank=rank, world=world, training=True, trained=trained)

    def valid(self, *, epoch: int, rank: int, world: int) -> Iterator[dict]:
        """Worker ``rank`` of ``world``'s share of the validation split, in its stored order."""
        return self.batches("valid", epoch=epoch, rank=rank, world=world, training=False)

    def stats(self, split: str) -> str:
        """Ray Data's per-operator stats of ``split``'s last pass (Ray Train's shard): its reads, steps and split,
        their time and rows; for a split this worker gathers from the cache itself, which Ray Data does not read,
        a line saying so."""
        if split in self.reading.indexed:
            return f"{split}: read from the cache by each worker itself (ingest.cache), without Ray Data's operators\n"
        return ray.train.get_dataset_shard(split).stats()

    def batches(
        self,
        split: str,
        *,
        epoch: int,
        rank: int,
        world: int,
        training: bool,
        trained: np.ndarray | None = None,
        shard=None,
    ) -> Iterator[dict[str, Any]]:
        """This worker's share of ``split`` (``epoch``'s pass) as batches on the device, after the device steps,
        without the rows ``trained`` on before a stop (an indexed split: Ray Data's passes leave them out, as the
        job's epochs actor says). Training shuffles in a local buffer (Ray Data's shards) and drops its last partial
        batch when ``ingest`` says so; validation never does. ``shard``: the Ray Data iterator to read (default: Ray
        Train's shard of the split)."""
        ingest, steps = self.reading.ingest, self.steps[split]
        collate = Collate(steps, epoch, self.device)
        drop_last, threads = ingest.drop_last and training, max(1, ingest.prefetch_batches)
        if split in self.reading.indexed:
            rows = self.read(self.reading.indexed[split], epoch, rank, world, trained, drop_last)
            return ahead(rows, lambda batch: self.prepared(collate(batch), steps), threads)
        options = {
            "batch_size": ingest.batch_size // world,
            "prefetch_batches": ingest.prefetch_batches,
            "local_shuffle_buffer_size": self.reading.shuffle_rows if training else None,
            "local_shuffle_seed": self.reading.seed + epoch,
            "drop_last": drop_last,
        }
        shard = shard if shard is not None else ray.train.get_dataset_shard(split)
        if not steps:
            return shard.iter_torch_batches(**options, device=self.device, pin_memory=self.device.type == "cuda")
        collated = shard.iter_torch_batches(**options, collate_fn=collate)
        return ahead(collated, lambda batch: self.prepared(batch, steps), threads)

    def read(
        self, indexed: Indexed, epoch: int, rank: int, world: int, trained: np.ndarray | None, drop_last: bool
    ) -> Iterator[dict[str, np.ndarray]]:
        """This worker's batches of an ``indexed`` split, gathered from its cache's pieces (held, mapped, for the
        epoch)."""
        batch = self.reading.ingest.batch_size // world
        left = indexed.rows - (int(np.unpackbits(trained).sum()) if trained is not None else 0)
        held: dict[ray.ObjectRef, dict[str, np.ndarray]] = {}
        dealt = Dealt()
        share = pieces.shard(
            indexed.cache,
            indexed.cache.windows,
            epoch,
            seed=indexed.cache.seed,
            numbers=indexed.numbers,
            done=trained,
            rank=rank,
            world=world,
            rows=left,
        )
        for window, mine in share:
            piece, place = window.where(mine)
            refs = np.empty(len(piece), dtype=object)
            refs[:] = [window.refs[i] for i in piece]
            dealt.add(refs, place, window.numbers[mine] if window.numbers is not None else place)
            while len(dealt) >= batch:
                yield self.gathered(indexed, held, *dealt.take(batch))
        if len(dealt) and not drop_last:
            yield self.gathered(indexed, held, *dealt.take(len(dealt)))

    def gathered(
        self, indexed: Indexed, held: dict, refs: np.ndarray, place: np.ndarray, numbers: np.ndarray
    ) -> dict[str, np.ndarray]:
        """The rows at ``place`` of the pieces ``refs`` (a row each), the split's ``columns`` and, for a numbered
        split, their numbers: the pieces are mapped from the object store once an epoch (``held``), and a ragged
        image is not copied until it is padded."""
        keys: dict[ray.ObjectRef, int] = {}
        piece = np.array([keys.setdefault(ref, len(keys)) for ref in refs])
        missing = [ref for ref in keys if ref not in held]
        held.update(zip(missing, ray.get(missing)))
        parts = {i: {name: held[ref][name] for name in self.reading.columns} for ref, i in keys.items()}
        rows = Cache.take(parts, piece, place)
        return rows | ({ROW: numbers} if indexed.numbers is not None else {})

    def prepared(self, collated: Collated, steps: list) -> dict[str, Any]:
        """A collated batch on the device, its device steps run (in a feed thread: on a GPU, launched on the stream
        the training step then uses)."""
        batch = {name: moved(value, self.device) for name, value in collated.batch.items()}
        for step, params in zip(steps, collated.params):
            batch = step(batch, params)
        return batch


class Dealt:
    """The rows dealt to a worker and not yet batched: runs of (their pieces' refs, their places in them, their
    numbers), taken from the front; a batch costs its own rows, never a copy of those still waiting (a window holds
    thousands of batches)."""

    def __init__(self) -> None:
        self.runs: collections.deque[tuple[np.ndarray, np.ndarray, np.ndarray]] = collections.deque()
        self.rows = 0

    def __len__(self) -> int:
        return self.rows

    def add(self, refs: np.ndarray, places: np.ndarray, numbers: np.ndarray) -> None:
        self.runs.append((refs, places, numbers))
        self.rows += len(places)

    def take(self, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The first ``count`` rows (refs, places, numbers); the rest of a run is left as a view of it."""
        taken = []
        self.rows -= count
        while count:
            run = self.runs.popleft()
            if len(run[1]) > count:
                self.runs.appendleft(tuple(column[count:] for column in run))
                run = tuple(column[:count] for column in run)
            taken.append(run)
            count -= len(run[1])
        return tuple(np.concatenate(columns) for columns in zip(*taken))


def moved(value: Any, device: torch.device) -> Any:
    """A column on the training device (``non_blocking``: from pinned memory the copy overlaps the step); encoded
    images stay where they are for the step that decodes them."""
    return value.to(device, non_blocking=True) if isinstance(value, (torch.Tensor, Ragged)) else value


def ahead(items: Iterator, work: Callable[[Any], Any], threads: int) -> Iterator:
    """``work(item)`` for each of ``items``, in order, done in ``threads`` threads up to ``threads`` items ahead of
    the caller (a DataLoader's workers and prefetch): ``items`` is drawn in a thread of its own, each item's work
    in the pool. An error there is raised here; a caller that stops early lets the threads (and so ``items``) go
    at their next item: the thread drawing them never waits on a caller that left."""
    pool = ThreadPoolExecutor(threads, thread_name_prefix="feed")
    futures: queue.Queue = queue.Queue(maxsize=threads)
    stop, end = threading.Event(), object()

    def hand(thing: Any) -> bool:
        """``thing`` to the caller, unless it stopped (then never blocks); whether it went."""
        while not stop.is_set():
            try:
                futures.put(thing, timeout=0.5)
                return True
            except queue.Full:
                continue
        return False

    def submit() -> None:
        try:
            for item in items:
                if not hand(pool.submit(work, item)):
                    return
            hand(end)
        except BaseException as err:  # handed to the caller, raised there
            hand(err)

    threading.Thread(target=submit, name="feed-order", daemon=True).start()
    try:
        while (future := futures.get()) is not end:
            if isinstance(future, BaseException):
                raise future
            yield future.result()
    finally:
        stop.set()
        pool.shutdown(wait=False, cancel_futures=True)
