"""Transforms stage (built on the driver, run in Ray Data's tasks and actors): each split's configured
transforms chained onto its dataset as lazy ``map_batches``.

Functions run as stateless Ray tasks; classes run as an actor pool (built once per actor, for
transforms with expensive set-up). Either way they use their own CPUs, not the training workers'.

A transform function that declares an ``epoch`` parameter is called with the training epoch its
pass belongs to, so seeded random augmentation changes every epoch and a resumed run repeats
exactly what an uninterrupted one would do. The training workers set that epoch on a small
:class:`EpochCounter` actor before each pass starts; Ray Data's split coordinator starts a pass
only once every worker has asked for it, so no task of the pass reads an older value.
"""

from __future__ import annotations

import functools
import inspect
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray
import ray.data
from hydra.utils import instantiate

from pipeline import source
from pipeline.config import active_steps, feature_key
from transforms.tabular import stack_features


@ray.remote(num_cpus=0)
class EpochCounter:
    """The training epoch now being read: set by the training workers, read by the transforms."""

    def __init__(self) -> None:
        self.epoch = 0

    def set(self, epoch: int) -> None:
        self.epoch = epoch

    def get(self) -> int:
        return self.epoch


@dataclass
class TrainingData:
    """What the training workers read: each split's lazy dataset, its row count (from the parquet
    footers, capped by ``source.limit``), the epoch counter its seeded steps follow and, with
    ``ingest.standardize``, the training features' mean and std."""

    datasets: dict[str, ray.data.Dataset]
    rows: dict[str, int]
    epoch_counter: Any  # an EpochCounter actor handle
    statistics: dict | None = None


def training_data(cfg: dict, splits: dict[str, source.Split]) -> TrainingData:
    """Each split read lazily with its transforms chained on (the training split shuffled, with
    ``ingest.shuffle``): nothing runs until a worker iterates, except the pass over the training
    split that ``ingest.standardize`` needs for its statistics."""
    src, counter = cfg["source"], EpochCounter.remote()
    columns = [feature_key(src), src["label_column"]]
    seed = cfg["train"]["seed"] if cfg["ingest"]["shuffle"] else None
    datasets = {
        name: dataset(split, cfg["transforms"][name], columns, src, counter, seed if name == "train" else None)
        for name, split in splits.items()
    }
    statistics = feature_statistics(datasets["train"], columns[0]) if cfg["ingest"]["standardize"] else None
    return TrainingData(datasets, {name: split.rows for name, split in splits.items()}, counter, statistics)


def dataset(
    split: source.Split,
    steps: dict[str, dict],
    columns: list[str],
    source_cfg: dict,
    epoch_counter=None,
    shuffle_seed: int | None = None,
):
    """``split`` read lazily (as ``source.*`` says), numeric feature columns stacked into one vector,
    shuffled with ``shuffle_seed``, spread over at least one block per CPU, with ``steps`` chained on.
    ``columns``: the feature column the model takes (see :func:`feature_key`), then any others to keep."""
    features = source.input_columns(source_cfg)
    tabular = isinstance(source_cfg["feature_column"], list) or split.vector_column(features[0])
    placed = read_placement(steps)  # these steps run where the reads do, fused with them
    ds = source.read(split, [*features, *columns[1:]], source_cfg, placed)
    if tabular:
        stacked = {"columns": features, "output": columns[0]}
        ds = ds.map_batches(stack_features, fn_kwargs=stacked, batch_size=None, **placed)
    if shuffle_seed is not None:
        shuffle = seeded(permuted, epoch_counter)
        ds = ds.map_batches(shuffle, fn_kwargs={"seed": shuffle_seed}, batch_size=None, **placed)
    blocks = max(len(split.files), int(ray.cluster_resources().get("CPU", 1)))
    if source_cfg["task_per_file"] and blocks > len(split.files):  # few, large files: still several tasks at once
        ds = ds.repartition(blocks)
    if shuffle_seed is not None:
        ds = ds.random_shuffle(seed=shuffle_seed, **placed)
    return apply(ds, steps, columns, epoch_counter)


def permuted(batch: dict[str, np.ndarray], seed: int, epoch: int = 0) -> dict[str, np.ndarray]:
    """The block's rows in an order drawn from (seed, epoch, the block's file and size). Before Ray Data's
    seeded ``random_shuffle`` (the same permutation of positions every epoch, so a resumed run repeats
    it), this makes each epoch's order new, yet the same for the same epoch in any run."""
    rows = len(batch["path"])
    where = zlib.crc32(str(batch["path"][0]).encode()) if rows else 0
    order = np.random.default_rng([seed, epoch, where, rows]).permutation(rows)
    return {key: values[order] for key, values in batch.items()}


def feature_statistics(ds, column: str) -> dict[str, list[float]]:
    """Per-feature mean and std of ``column`` over ``ds`` (one pass; a constant feature gets std 1)."""

    def moments(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        values = batch[column].astype(np.float64)
        return {"rows": np.array([len(values)]), "sum": values.sum(0)[None], "squares": (values**2).sum(0)[None]}

    parts = ds.select_columns([column]).map_batches(moments, batch_size=None).take_all()
    rows = sum(int(part["rows"]) for part in parts)
    mean = sum(part["sum"] for part in parts) / rows
    std = np.sqrt(np.maximum(sum(part["squares"] for part in parts) / rows - mean**2, 0.0))
    return {"mean": mean.tolist(), "std": np.where(std > 1e-12, std, 1.0).tolist()}


def apply(ds, specs: dict[str, dict], columns: list[str], epoch_counter=None):
    """Return ``ds`` with every transform in ``specs`` (name -> TransformSpec dict) appended, in order,
    then only ``columns`` kept (the reader's ``path`` column serves error messages, not training),
    where the last step ran. Without an ``epoch_counter`` (prediction), ``epoch`` keeps its default."""
    last: dict = {}
    for spec in active_steps(specs).values():
        fn = instantiate(spec["fn"], _partial_=True, _convert_="all")
        options = {
            "batch_format": "numpy",
            "batch_size": spec["batch_size"],
            "num_cpus": spec["num_cpus"],
            **placement(spec),
        }
        if isinstance(fn, functools.partial) and isinstance(fn.func, type):
            pool = ray.data.ActorPoolStrategy(size=spec["concurrency"] or 1)
            ds = ds.map_batches(fn.func, fn_constructor_kwargs=fn.keywords, compute=pool, **options)
        else:
            fn = seeded(fn, epoch_counter)
            ds = ds.map_batches(fn, compute=ray.data.TaskPoolStrategy(size=spec["concurrency"]), **options)
        last = placement(spec)
    return ds.select_columns(columns, **last)


def seeded(fn, epoch_counter):
    """``fn`` with ``epoch`` bound, when a Ray Data task calls it, to the epoch the workers are reading
    (one actor call per batch; steps with ``batch_size: null`` take a whole file per batch); ``fn``
    itself when it takes no ``epoch`` or there is no counter (prediction: ``epoch`` keeps its default)."""
    if epoch_counter is None or "epoch" not in inspect.signature(fn).parameters:
        return fn

    def call(batch: dict[str, np.ndarray], **kwargs) -> dict[str, np.ndarray]:
        return fn(batch, epoch=ray.get(epoch_counter.get.remote()), **kwargs)

    call.__name__ = call.__qualname__ = getattr(fn, "func", fn).__name__  # Ray names the operator after it
    return call


def placement(spec: dict) -> dict:
    """Ray's options for where a step's tasks or actors may run: the custom resources and node labels
    it asks for (none: any node with a free CPU)."""
    return {key: spec[key] for key in ("resources", "label_selector") if spec[key]}


def read_placement(specs: dict[str, dict]) -> dict:
    """Reading runs where the split's first step does, so a cluster's reads stay on its preprocessing
    nodes and Ray Data can fuse the read with that step into one task (select_columns, likewise,
    runs where the last step does)."""
    steps = list(active_steps(specs).values())
    return placement(steps[0]) if steps else {}
