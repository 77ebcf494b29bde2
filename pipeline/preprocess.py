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
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray
import ray.data
from hydra.utils import instantiate

from pipeline import source
from pipeline.config import active_steps


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
    footers, capped by ``source.limit``), and the epoch counter its seeded transforms follow."""

    datasets: dict[str, ray.data.Dataset]
    rows: dict[str, int]
    epoch_counter: Any  # an EpochCounter actor handle


def training_data(cfg: dict, splits: dict[str, source.Split]) -> TrainingData:
    """Each split read lazily with its transforms chained on: nothing runs until a worker iterates."""
    src, counter = cfg["source"], EpochCounter.remote()
    columns = [src["feature_column"], src["label_column"]]
    datasets = {name: dataset(split, cfg["transforms"][name], columns, src, counter) for name, split in splits.items()}
    return TrainingData(datasets, {name: split.rows for name, split in splits.items()}, counter)


def dataset(split: source.Split, steps: dict[str, dict], columns: list[str], source_cfg: dict, epoch_counter=None):
    """``split`` read lazily (as ``source.*`` says) with ``steps`` chained on."""
    read = source.read(split, columns, source_cfg, read_placement(steps))
    return apply(read, steps, columns, epoch_counter)


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
            if epoch_counter is not None and "epoch" in inspect.signature(fn).parameters:
                fn = with_epoch(fn, epoch_counter)
            ds = ds.map_batches(fn, compute=ray.data.TaskPoolStrategy(size=spec["concurrency"]), **options)
        last = placement(spec)
    return ds.select_columns(columns, **last)


def with_epoch(fn, epoch_counter):
    """``fn`` with ``epoch`` bound, when a Ray Data task calls it, to the epoch the workers are reading
    (one actor call per batch; steps with ``batch_size: null`` take a whole file per batch)."""

    def call(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return fn(batch, epoch=ray.get(epoch_counter.get.remote()))

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
