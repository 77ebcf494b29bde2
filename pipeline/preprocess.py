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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import ray
import ray.data
from hydra.utils import instantiate
from ray.exceptions import RayError

from pipeline import cache, source, workarounds
from pipeline.config import PipelineConfig, PredictConfig, SourceConfig, TransformSpec
from pipeline.errors import PipelineError
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
    footers, capped by ``source.limit``), the epoch counter its seeded steps follow, with
    ``ingest.standardize`` the training features' mean and std, and the cache (see ``plan``)."""

    datasets: dict[str, ray.data.Dataset]
    rows: dict[str, int]
    epoch_counter: Any  # an EpochCounter actor handle
    statistics: dict | None = None
    plan: CachePlan | None = None
    caches: dict[str, cache.Cache] = field(default_factory=dict)  # split -> its cache, with the plan on

    def __enter__(self) -> TrainingData:
        return self

    def __exit__(self, *exc_info) -> None:
        """The job is over: its epoch counter goes (the datasets' tasks end with their job)."""
        ray.kill(self.epoch_counter)


@dataclass
class CachePlan:
    """Whether each split's deterministic steps run once, their output kept in Ray's object store, or
    every epoch: the estimate it was decided on and, once built, what the cache holds."""

    on: bool
    estimate_bytes: int  # every split's cached stage, from the first rows of its first file
    capacity_bytes: int  # ingest.cache_share of the object store
    row_bytes: dict[str, float] = field(default_factory=dict)  # split -> estimated bytes a cached row takes
    built: dict[str, TransformSpec] = field(default_factory=dict)  # split -> rows, bytes, seconds (cache.Cache.built)

    def summary(self) -> str:
        """One line for the console and the run's ``pipeline.cache`` tag."""
        share = f"{self.estimate_bytes / 2**20:,.0f} MiB estimated, {self.capacity_bytes / 2**20:,.0f} MiB allowed"
        if not self.on and not self.row_bytes:
            return "not cached (ingest.cache=false): every step runs every epoch"
        if not self.on:
            return f"not cached, every step runs every epoch ({share}: ingest.cache, ingest.cache_share)"
        parts = [
            f"{name} {built['rows']:,} rows, {built['bytes'] / 2**20:,.1f} MiB in {built['seconds']:.1f} s"
            for name, built in self.built.items()
        ]
        return f"cached in Ray's object store: {'; '.join(parts) or 'building'} ({share})"


def training_data(cfg: PipelineConfig, splits: dict[str, source.Split], plan: CachePlan | None = None) -> TrainingData:
    """Each split read lazily with its transforms chained on (the training split shuffled, with
    ``ingest.shuffle``). With the cache on (``plan``, else decided here), each split's steps that run
    once are submitted now, as Ray tasks, and training reads their output as it comes; only
    ``ingest.standardize`` waits, for its pass over the training split: a transform that fails there
    fails the job here, in one line naming the cause. Use it as a context manager: leaving the ``with``
    block ends the epoch counter."""
    src, counter, ingest = cfg.source, EpochCounter.remote(), cfg.ingest
    layout = splits["train"].layout
    columns = [layout.model_input, layout.label]
    seed = cfg.train.seed if ingest.shuffle else None
    plan = plan or cache_plan(cfg, splits)
    datasets, caches = {}, {}
    try:
        for name, split in splits.items():
            shuffle, steps = seed if name == "train" else None, split.steps
            if plan.on:
                datasets[name], caches[name] = cached_dataset(
                    split, steps, columns, src, counter, shuffle, plan.row_bytes[name]
                )
            else:
                datasets[name] = dataset(split, steps, columns, src, counter, shuffle)
        stacked = layout.inputs if layout.stacked else None
        statistics = feature_statistics(datasets["train"], columns[0], stacked) if ingest.standardize else None
    except BaseException as err:
        ray.kill(counter)
        if isinstance(err, RayError):
            raise PipelineError(
                f"preprocessing failed: {workarounds.root_cause(err)} (full tracebacks: Ray's session logs, "
                "/tmp/ray/session_latest/logs on the head node)."
            ) from err
        raise
    rows = {name: split.rows for name, split in splits.items()}
    return TrainingData(datasets, rows, counter, statistics, plan, caches)


def dataset(
    split: source.Split,
    steps: dict[str, TransformSpec],
    columns: list[str],
    source_cfg: SourceConfig,
    epoch_counter=None,
    shuffle_seed: int | None = None,
):
    """``split`` read lazily (as ``source.*`` says), numeric feature columns stacked into one vector,
    shuffled with ``shuffle_seed``, spread over at least one block per CPU, with ``steps`` chained on:
    every step runs every epoch (the cache off, and prediction).
    ``columns``: the column the model takes (the split's ``layout.model_input``), then any others to keep."""
    features = split.layout.inputs
    placed = read_placement(steps)  # these steps run where the reads do, fused with them
    ds = source.read(split, [*features, *columns[1:]], source_cfg, placed)
    for fn, kwargs in read_steps(split):
        ds = ds.map_batches(fn, fn_kwargs=kwargs, batch_size=None, **placed)
    if shuffle_seed is not None:
        shuffle = seeded(permuted, epoch_counter)
        ds = ds.map_batches(shuffle, fn_kwargs={"seed": shuffle_seed}, batch_size=None, **placed)
    blocks = max(len(split.files), int(ray.cluster_resources().get("CPU", 1)))
    if source_cfg.task_per_file and blocks > len(split.files):  # few, large files: still several tasks at once
        ds = ds.repartition(blocks)
    if shuffle_seed is not None:
        ds = ds.random_shuffle(seed=shuffle_seed, **placed)
    return apply(ds, steps, columns, epoch_counter)


def cached_dataset(
    split: source.Split,
    steps: dict[str, TransformSpec],
    columns: list[str],
    source_cfg: SourceConfig,
    epoch_counter,
    shuffle_seed: int | None,
    row_bytes: float,
) -> tuple[ray.data.Dataset, cache.Cache]:
    """``split`` with its steps that run once submitted now as Ray tasks (:mod:`pipeline.cache`), and a
    lazy dataset that reads their output each epoch, mixed with ``shuffle_seed``, with the per-epoch steps
    chained on. ``columns`` as :func:`dataset`'s."""
    once, every_epoch = cached_steps(steps)
    features = split.layout.inputs
    prepare = Steps(once, read_steps(split))
    first = next(iter(once.values()), None)
    build_options = {
        "num_cpus": max((s.num_cpus for s in once.values()), default=1.0),
        **(placement(first) if first else {}),
    }
    groups = cache.row_groups(split.files, split.filesystem, source_cfg.limit)
    pieces = cache.build(groups, split.filesystem, [*features, *columns[1:]], prepare, row_bytes, build_options)
    bind = functools.partial(seeded, epoch_counter=epoch_counter)
    inline = not any(is_class(spec) for spec in every_epoch.values())  # class steps need their actor pools
    then = Steps(every_epoch if inline else {}, [])
    later = {} if inline else every_epoch
    epoch_options = {"num_cpus": max((s.num_cpus for s in every_epoch.values()), default=1.0)} if inline else {}
    ds = cache.dataset(pieces, shuffle_seed, then, bind, {**epoch_options, **read_placement(every_epoch)})
    return apply(ds, later, columns, epoch_counter), pieces


def read_steps(split: source.Split) -> list[tuple[Callable, dict]]:
    """What a split's rows go through as read, before any configured step: class names made their index,
    a table's numeric columns stacked into one vector (each a function and its arguments)."""
    layout, steps = split.layout, []
    if layout.classes is not None:
        steps.append((class_indices, {"column": layout.label, "classes": layout.classes}))
    if split.tabular:
        stacking = {"columns": layout.inputs, "output": layout.model_input, "on_missing": layout.on_missing}
        steps.append((stack_features, stacking))
    return steps


def class_indices(batch: dict[str, np.ndarray], column: str, classes: list[str]) -> dict[str, np.ndarray]:
    """Class names in ``column`` as their index in ``classes`` (every name is one: checked before training)."""
    order = np.argsort(classes)
    found = np.searchsorted(np.asarray(classes)[order], batch[column].astype(str))
    return {**batch, column: order[np.minimum(found, len(classes) - 1)].astype(np.int64)}


class Steps:
    """Transform steps run in one process, one after another, on a batch: ``first`` (:func:`read_steps`),
    then each step (a class step built here), those that take an ``epoch`` given the one the call passes.
    Steps are built on first use, once per process that runs them."""

    def __init__(self, specs: dict[str, TransformSpec], first: list[tuple[Callable, dict]]):
        self.specs, self.first, self.fns = specs, first, None

    def __call__(self, batch: dict[str, np.ndarray], epoch: int | None = None) -> dict[str, np.ndarray]:
        if self.fns is None:
            self.fns = [built(spec) for spec in self.specs.values()]
        for fn, kwargs in self.first:
            batch = fn(batch, **kwargs)
        for fn, takes in self.fns:
            batch = fn(batch, epoch=epoch) if takes and epoch is not None else fn(batch)
        return batch


def built(spec: TransformSpec) -> tuple[Any, bool]:
    """A step's callable (a class step's instance) and whether it takes an ``epoch``."""
    fn = instantiate(spec.fn, _partial_=True, _convert_="all")
    if is_class(spec):
        return fn.func(**fn.keywords), False
    return fn, "epoch" in inspect.signature(fn).parameters


def is_class(spec: TransformSpec) -> bool:
    """Whether a step's ``fn`` names a class (run as an actor pool) rather than a function."""
    fn = instantiate(spec.fn, _partial_=True, _convert_="all")
    return isinstance(fn, functools.partial) and isinstance(fn.func, type)


def cached_steps(steps: dict[str, TransformSpec]) -> tuple[dict[str, TransformSpec], dict[str, TransformSpec]]:
    """The steps that run once (up to the first that runs every epoch) and those that run every epoch.
    A step runs every epoch when its ``cache`` says false, or, unset, when its function takes the
    ``epoch`` (seeded augmentation: a new draw each epoch)."""
    names = list(steps)
    for i, spec in enumerate(steps.values()):
        per_epoch = not spec.cache if spec.cache is not None else takes_epoch(spec)
        if per_epoch:
            return {n: steps[n] for n in names[:i]}, {n: steps[n] for n in names[i:]}
    return steps, {}


def takes_epoch(spec: TransformSpec) -> bool:
    """Whether a step's function (not a class: actors are not told the epoch) declares an ``epoch`` parameter."""
    fn = instantiate(spec.fn, _partial_=True, _convert_="all")
    target = fn.func if isinstance(fn, functools.partial) else fn
    return not isinstance(target, type) and "epoch" in inspect.signature(target).parameters


SAMPLE_ROWS = 32  # rows of each split's first file run through its cached steps to estimate the cache


def cache_plan(cfg: PipelineConfig, splits: dict[str, source.Split]) -> CachePlan:
    """``ingest.cache`` decided before anything is recorded: the cached stage's size estimated from the
    first rows of each split (run through its once-only steps here, on the driver) against
    ``ingest.cache_share`` of Ray's object store. ``auto`` streams what does not fit; ``true`` fails."""
    ingest = cfg.ingest
    capacity = int(ray.cluster_resources().get("object_store_memory", 0) * ingest.cache_share)
    if ingest.cache is False:
        return CachePlan(False, 0, capacity)
    row_bytes = {}
    for name, split in splits.items():
        once, _ = cached_steps(split.steps)
        try:
            sample = sample_rows(split, once)
        except Exception as err:  # a transform's own error about the user's data: it names the file and row
            raise PipelineError(f"transforms.{name}: {type(err).__name__}: {err}") from err
        row_bytes[name] = cache.batch_bytes(sample) / max(len(sample["path"]), 1)
    estimate = round(sum(row_bytes[name] * split.rows for name, split in splits.items()))
    if estimate > capacity and ingest.cache is True:
        raise PipelineError(
            f"ingest.cache=true: the cached steps' output is about {estimate / 2**20:,.0f} MiB (estimated from "
            f"the first {SAMPLE_ROWS} rows of each split), more than ingest.cache_share={ingest.cache_share:g} of "
            f"Ray's object store ({capacity / 2**20:,.0f} MiB). Set ingest.cache=auto (streams what does not fit) or "
            "false, cache a smaller working size (the decode step's resize), or give Ray a larger object store "
            "(ray.object_store_memory=BYTES, or ray start --object-store-memory on a cluster)."
        )
    return CachePlan(estimate <= capacity, estimate, capacity, row_bytes)


def sample_rows(split: source.Split, steps: dict[str, TransformSpec]) -> dict[str, np.ndarray]:
    """The first rows of the split's first file as a Ray Data batch would hold them, through ``steps``."""
    layout = split.layout
    reader = pq.ParquetFile(split.files[0], filesystem=split.filesystem)
    table = pa.Table.from_batches([next(reader.iter_batches(SAMPLE_ROWS, columns=[*layout.inputs, layout.label]))])
    return Steps(steps, read_steps(split))(cache.numpy_batch(table, split.files[0]))


def permuted(batch: dict[str, np.ndarray], seed: int, epoch: int = 0) -> dict[str, np.ndarray]:
    """The block's rows in an order drawn from (seed, epoch, the block's file and size). Before Ray Data's
    seeded ``random_shuffle`` (the same permutation of positions every epoch, so a resumed run repeats
    it), this makes each epoch's order new, yet the same for the same epoch in any run."""
    rows = len(batch["path"])
    where = zlib.crc32(str(batch["path"][0]).encode()) if rows else 0
    order = np.random.default_rng([seed, epoch, where, rows]).permutation(rows)
    return {key: values[order] for key, values in batch.items()}


def feature_statistics(ds, column: str, names: list[str] | None = None) -> dict[str, list[float]]:
    """Per-feature mean and std of ``column`` over ``ds`` (one pass; a constant feature gets std 1), over the
    values present (``source.on_missing: mean`` leaves missing ones NaN). A feature with no value, or
    whose statistics overflow, fails naming it (``names``: the table's columns stacked into ``column``)."""

    def moments(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        values = batch[column].astype(np.float64)
        present = np.isfinite(values)
        values = np.where(present, values, 0.0)
        return {"rows": present.sum(0)[None], "sum": values.sum(0)[None], "squares": (values**2).sum(0)[None]}

    parts = ds.select_columns([column]).map_batches(moments, batch_size=None).take_all()
    rows = sum(part["rows"] for part in parts)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = sum(part["sum"] for part in parts) / rows
        std = np.sqrt(np.maximum(sum(part["squares"] for part in parts) / rows - mean**2, 0.0))
    bad = np.flatnonzero(~np.isfinite(mean) | ~np.isfinite(std))
    if len(bad):
        i = bad[0]
        named = f" (column {names[i]!r})" if names else ""
        raise PipelineError(
            f"ingest.standardize: feature {i} of {column!r}{named} has no finite mean and std over the training split "
            f"(mean {mean[i]}, std {std[i]}, from {int(rows[i])} value(s)): every value is missing, or they overflow. "
            "Drop or fix that column (source.feature_column)."
        )
    return {"mean": mean.tolist(), "std": np.where(std > 1e-12, std, 1.0).tolist()}


def apply(ds, specs: dict[str, TransformSpec], columns: list[str] | None, epoch_counter=None):
    """Return ``ds`` with every transform in ``specs`` (name -> TransformSpec dict, none null) appended, in order,
    then only ``columns`` kept (the reader's ``path`` column serves error messages, not training),
    where the last step ran; ``None`` keeps every column. Without an ``epoch_counter`` (prediction),
    ``epoch`` keeps its default."""
    last: dict = {}
    for spec in specs.values():
        fn = instantiate(spec.fn, _partial_=True, _convert_="all")
        options = {
            "batch_format": "numpy",
            "batch_size": spec.batch_size,
            "num_cpus": spec.num_cpus,
            **placement(spec),
        }
        if isinstance(fn, functools.partial) and isinstance(fn.func, type):
            pool = ray.data.ActorPoolStrategy(size=spec.concurrency or 1)
            ds = ds.map_batches(fn.func, fn_constructor_kwargs=fn.keywords, compute=pool, **options)
        else:
            fn = seeded(fn, epoch_counter)
            ds = ds.map_batches(fn, compute=ray.data.TaskPoolStrategy(size=spec.concurrency), **options)
        last = placement(spec)
    return ds if columns is None else ds.select_columns(columns, **last)


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


def placement(spec: TransformSpec | PredictConfig) -> dict:
    """Ray's options for where a step's tasks or actors (or predict's replicas) may run: the custom resources
    and node labels it asks for (none: any node with a free CPU)."""
    wanted = {"resources": spec.resources, "label_selector": spec.label_selector}
    return {key: dict(value) for key, value in wanted.items() if value}


def read_placement(specs: dict[str, TransformSpec]) -> dict:
    """Reading runs where the split's first step does, so a cluster's reads stay on its preprocessing
    nodes and Ray Data can fuse the read with that step into one task (select_columns, likewise,
    runs where the last step does)."""
    steps = list(specs.values())
    return placement(steps[0]) if steps else {}
