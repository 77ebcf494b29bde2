"""Transforms stage (built on the driver; Ray Data's tasks run it): each split's dataset, its configured steps
(:mod:`pipeline.data.steps`) chained on, read anew every epoch by Ray Data's read tasks in a seeded order
(:mod:`pipeline.data.epochs`) from storage (streamed) or from the cache of its steps that run once
(:mod:`pipeline.data.cache`; which of the two: :mod:`pipeline.data.cache_plan`), or, for a cache on one node, by the
training workers themselves; what the workers read each split with (:class:`pipeline.data.epochs.Reading`); how
well an epoch mixes the training split (:mod:`pipeline.data.mixing`); and prediction's rows, read by Ray Data in their
stored order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray
import ray.data
from ray.exceptions import RayError

from pipeline.common import workarounds
from pipeline.common.errors import PipelineError, root_cause
from pipeline.config import Layout, PipelineConfig, SourceConfig, TransformSpec
from pipeline.data import cache, epochs, pieces, source
from pipeline.data.cache_plan import CachePlan, cache_plan
from pipeline.data.mixing import Mixing, buffers_mix, mixing, shuffle_rows
from pipeline.data.steps import (
    Steps,
    apply,
    cached_steps,
    device_split,
    placement,
    read_placement,
    read_steps,
    streamed_steps,
)
from pipeline.runtime.cluster import alive_nodes, on_this_node, placeable_nodes


@dataclass(kw_only=True)
class TrainingData:
    """What the job trains on: the datasets Ray Train splits among the workers (each split the workers do not read
    themselves), each split's row count (from the parquet footers, capped by ``source.limit``), the job's
    :class:`pipeline.data.epochs.Epochs` actor, with ``ingest.standardize`` the training features' mean and std, the
    cache (see ``plan``), how an epoch mixes the training split (``mixing``), the steps the workers run on their device
    and the caches they read themselves."""

    datasets: dict[str, ray.data.Dataset]
    rows: dict[str, int]
    epochs: Any  # a pipeline.data.epochs.Epochs actor handle
    statistics: dict | None = None
    plan: CachePlan | None = None
    caches: dict[str, cache.Cache] = field(default_factory=dict)  # split -> its cache, with the plan on
    mixing: Mixing | None = None
    shuffle_rows: int | None = None  # each worker's local shuffle buffer of the training split (None: none)
    # split -> the steps the training workers run on their device, after the batches reach them (steps.device_split)
    on_device: dict[str, dict[str, TransformSpec]] = field(default_factory=dict)
    # split -> its cache, where the training workers read its rows themselves (no dataset for Ray Train to split)
    indexed: dict[str, cache.Indexed] = field(default_factory=dict)

    def __enter__(self) -> TrainingData:
        return self

    def __exit__(self, *exc_info) -> None:
        """The job is over: its epochs actor goes (the datasets' tasks end with their job)."""
        ray.kill(self.epochs)

    def reading(self, cfg: PipelineConfig) -> epochs.Reading:
        """What the training workers read each split with (:mod:`pipeline.data.feed`)."""
        layout = Layout.of(cfg.source)
        return epochs.Reading(
            epochs=self.epochs,
            on_device=self.on_device,
            indexed=self.indexed,
            columns=[layout.model_input, layout.label],
            ingest=cfg.ingest,
            seed=cfg.train.seed,
            shuffle_rows=self.shuffle_rows,
        )

    def device_steps(self) -> str | None:
        """Which steps the training workers run on their device, per split (None: none do)."""
        return "; ".join(f"{split}: {', '.join(steps)}" for split, steps in self.on_device.items() if steps) or None

    def reads(self) -> str | None:
        """Where the splits were read from storage so far, each node's share of the bytes, and the read tasks Ray ran
        again (a lost node's blocks rebuilt); None: nothing was read."""
        by_node, again = ray.get(self.epochs.reads.remote())
        total = sum(by_node.values())
        if not total:
            return None
        shares = ", ".join(f"{node[:8]} {size / total:.0%}" for node, size in sorted(by_node.items()))
        rebuilt = f"; {again} read task(s) run again (what a lost node held)" if again else ""
        return f"{total / 2**20:,.1f} MiB read on {len(by_node)} node(s): {shares}{rebuilt}"


def training_data(cfg: PipelineConfig, splits: dict[str, source.Split], plan: CachePlan | None = None) -> TrainingData:
    """Each split's dataset, its transforms chained on (the training split in a new order every epoch, with
    ``ingest.shuffle``). With the cache on (``plan``, else decided here), each split's steps that run once are
    submitted now, as Ray tasks, and training reads their output as it comes; on one node the workers read it
    themselves, where no step is left for Ray Data's tasks. A split that is not cached is read from storage every
    epoch. Only ``ingest.standardize`` waits, for its pass over the training split: a transform that fails there
    fails the job here, in one line naming the cause. Use it as a context manager: leaving the ``with`` block ends
    the job's epochs actor."""
    ingest = cfg.ingest
    layout = splits["train"].layout
    columns = [layout.model_input, layout.label]
    seed = cfg.train.seed if ingest.shuffle else None
    plan = plan or cache_plan(cfg, splits)
    one_node = len(alive_nodes()) == 1
    data = TrainingData(
        datasets={},
        rows={name: split.rows for name, split in splits.items()},
        epochs=epochs.Epochs.options(**on_this_node()).remote(),  # goes with the driver, never with a lost node
        plan=plan,
    )
    try:
        for name, split in splits.items():
            shuffle = seed if name == "train" else None
            groups = pieces.row_groups(split.files, split.filesystem, cfg.source.limit, layout.label)
            numbers = pieces.row_numbers(groups) if name == "train" else None
            every_epoch = cached_steps(split.steps)[1] if plan.on else streamed_steps(split.steps)
            # on one node (not with ingest.standardize, whose pass over the split reads its rows) on_device auto sends
            # the per-epoch steps to the workers, on any device: they decode and crop in their feed threads what the
            # read tasks hand on as stored (streamed), or, with nothing left to run in Ray Data's tasks, gather the
            # rows of a cache themselves (not where its pieces may sit on other nodes)
            here = one_node and not ingest.standardize
            readable = plan.on and here
            in_tasks, data.on_device[name] = device_split(every_epoch, cfg.scaling.use_gpu or here)
            if plan.on:
                built = data.caches[name] = cached_split(split, groups, columns, shuffle, plan.row_bytes[name])
            indexed = plan.on and readable and not in_tasks
            if name == "train" and not indexed:  # a cache the workers read themselves is shuffled whole (pieces.shard)
                once = cached_steps(split.steps)[0] if plan.on else {}
                data.shuffle_rows = shuffle_rows(cfg, split, {**once, **in_tasks}, groups)
            buffered = name == "train" and not indexed and buffers_mix(groups, split, data.shuffle_rows, cfg)
            if indexed:
                data.indexed[name] = cache.Indexed(cache=built, rows=split.rows, numbers=numbers)
                tasks = built.windows.later
            else:
                columns_read = [*split.layout.inputs, *columns[1:]]
                parts = (
                    epochs.cached_parts(built, groups, plan.row_bytes[name])
                    if plan.on
                    else epochs.stored_parts(groups, split.filesystem, columns_read)
                )
                data.datasets[name], tasks = read_epochs(
                    parts,
                    in_tasks,
                    [] if plan.on else read_steps(split),
                    columns,
                    cfg,
                    name=name,
                    epoch_actor=data.epochs,
                    seed=shuffle,
                    numbers=numbers,
                    where=read_placement(every_epoch if plan.on else split.steps),
                    mix=not buffered,
                )
            if name == "train":
                data.mixing = mixing(groups, tasks, shuffle, layout, cfg, buffer=data.shuffle_rows)
        stacked = layout.inputs if layout.stacked else None
        if ingest.standardize:
            data.statistics = feature_statistics(data.datasets["train"], columns[0], stacked)
    except BaseException as err:
        data.__exit__()
        if isinstance(err, RayError):
            raise PipelineError(
                f"preprocessing failed: {root_cause(err)} (full tracebacks: Ray's session logs, "
                "/tmp/ray/session_latest/logs on the head node)."
            ) from err
        raise
    return data


def dataset(
    split: source.Split,
    steps: dict[str, TransformSpec],
    columns: list[str],
    source_cfg: SourceConfig,
):
    """``split`` read lazily (as ``source.*`` says) in its stored order, numeric feature columns stacked into
    one vector, spread over at least one block per CPU, with ``steps`` chained on: every step runs every
    epoch (prediction's rows).
    ``columns``: the column the model takes (the split's ``layout.model_input``), then any others to keep."""
    features = split.layout.inputs
    placed = read_placement(steps)  # these steps run where the reads do, fused with them
    ds = source.read(split, [*features, *columns[1:]], source_cfg, placed)
    for fn, kwargs in read_steps(split):
        ds = ds.map_batches(fn, fn_kwargs=kwargs, batch_size=None, **placed)
    blocks = max(len(split.files), int(ray.cluster_resources().get("CPU", 1)))
    if source_cfg.task_per_file and blocks > len(split.files):  # few, large files: still several tasks at once
        ds = ds.repartition(blocks)
    return apply(ds, steps, columns)


def read_epochs(
    parts: epochs.Parts,
    steps: dict[str, TransformSpec],
    first: list,
    columns: list[str],
    cfg: PipelineConfig,
    *,
    name: str,
    epoch_actor,
    seed: int | None,
    numbers: np.ndarray | None,
    where: dict,
    mix: bool = True,
) -> tuple[ray.data.Dataset, int]:
    """A split's ``parts`` read anew every epoch by Ray Data's read tasks (:class:`pipeline.data.epochs.EpochSource`:
    in an order drawn from ``seed`` and the epoch ``epoch_actor`` holds; rows numbered from ``numbers``), ``first``
    (:func:`pipeline.data.steps.read_steps`) and ``steps`` run on them by ``map_batches`` placed as ``where`` says
    (:func:`pipeline.data.steps.placement`), fused with the reads, keeping ``columns``; handed on in blocks of one
    worker's batch; ``mix`` false: each task's rows left in their stored order (the workers' shuffle buffers hold the
    whole split). Where nothing runs after the read (no step, no ``first``), the read tasks hand on ``columns`` as
    stored, not through a batch of numpy objects and back. With it, how many read tasks an epoch has."""
    block_rows = max(1, cfg.ingest.batch_size // cfg.scaling.max_workers)
    cpus = sum(node["Resources"].get("CPU", 0) for node in placeable_nodes(where)) or 1
    tasks = epochs.epoch_tasks(parts, int(cpus), cfg.ingest.read_task_mib * 2**20)
    bare = not steps and not first
    read = epochs.EpochSource(
        parts,
        name=name,
        epochs=epoch_actor,
        seed=seed,
        numbers=numbers,
        tasks=tasks,
        block_rows=block_rows,
        mix=mix,
        keep=columns if bare else None,
    )
    options = {"num_cpus": max((s.num_cpus for s in steps.values()), default=1.0), **where}
    ds = ray.data.read_datasource(read, override_num_blocks=read.tasks, **where)  # no SplitBlocks: fused with the steps
    if not bare:  # the steps take each block as read (a batch of a size would keep them apart from the read)
        ds = ds.map_batches(Steps(steps, first, keep=columns), batch_size=None, **options)
    ds = ds.repartition(target_num_rows_per_block=block_rows)  # blocks of one worker's batch
    return workarounds.streamed_blocks(ds), read.tasks


def cached_split(
    split: source.Split, groups: list[pieces.RowGroup], columns: list[str], shuffle_seed: int | None, row_bytes: float
) -> cache.Cache:
    """``split`` (its row ``groups``) with its steps that run once submitted now as Ray tasks
    (:mod:`pipeline.data.cache`), built in the order epoch 0 reads them (``shuffle_seed``'s); ``columns`` as
    :func:`dataset`'s."""
    once, _ = cached_steps(split.steps)
    first = next(iter(once.values()), None)
    build_options = {
        "num_cpus": max((s.num_cpus for s in once.values()), default=1.0),
        **(placement(first) if first else {}),
    }
    return cache.build(
        groups,
        split.filesystem,
        [*split.layout.inputs, *columns[1:]],
        prepare=Steps(once, read_steps(split)),
        row_bytes=row_bytes,
        seed=shuffle_seed,
        options=build_options,
    )


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
