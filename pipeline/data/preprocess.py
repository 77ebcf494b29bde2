"""Transforms stage (built on the driver, run in Ray tasks and actors): each split's dataset, its configured
steps (:mod:`pipeline.data.steps`) chained on, read one of two ways: cached (:mod:`pipeline.data.cache`: the steps that
run once, kept in Ray's object store) or streamed (:mod:`pipeline.data.stream`: read anew every epoch), the
training split in a seeded order, new every epoch (which of the two: :mod:`pipeline.data.cache_plan`); how well
the training split's windows mix it; and prediction's
rows, read by Ray Data in their stored order.
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
from pipeline.config import IngestEngine, PipelineConfig, SourceConfig, TransformSpec
from pipeline.data import cache, epochs, pieces, source, stream
from pipeline.data.cache_plan import CachePlan, cache_plan
from pipeline.data.coordinator import Coordinator
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

MIX_WARNING = 0.9  # a training split whose windows hold less of its labels than this (of a full shuffle's) warns


@dataclass(kw_only=True)
class TrainingData:
    """What the training workers read: each split's lazy dataset, its row count (from the parquet
    footers, capped by ``source.limit``), the job's coordinator (the epoch its seeded steps follow, the
    streams' windows), with ``ingest.standardize`` the training features' mean and std, the cache (see
    ``plan``), and how the training split's windows mix it (``mixing``)."""

    datasets: dict[str, ray.data.Dataset]
    rows: dict[str, int]
    coordinator: Any  # a pipeline.data.coordinator.Coordinator actor handle
    statistics: dict | None = None
    plan: CachePlan | None = None
    caches: dict[str, cache.Cache] = field(default_factory=dict)  # split -> its cache, with the plan on
    streams: dict[str, stream.Stream] = field(default_factory=dict)  # split -> its stream, with the plan off
    mixing: Mixing | None = None
    # split -> the steps the training workers run on their device, after the batches reach them (steps.device_split)
    on_device: dict[str, dict[str, TransformSpec]] = field(default_factory=dict)
    # split -> its cache, where the training workers read its rows themselves (no dataset for Ray Train to split)
    indexed: dict[str, cache.Indexed] = field(default_factory=dict)

    def __enter__(self) -> TrainingData:
        return self

    def __exit__(self, *exc_info) -> None:
        """The job is over: its coordinator goes, and with it its readers and the pieces they hold (the datasets'
        tasks end with their job)."""
        ray.kill(self.coordinator)

    def reading(self, cfg: PipelineConfig) -> epochs.Reading:
        """What the training workers read each split with (:mod:`pipeline.data.feed`)."""
        layout = source.Layout.of(cfg.source)
        return epochs.Reading(
            epochs=self.coordinator,
            on_device=self.on_device,
            indexed=self.indexed,
            columns=[layout.model_input, layout.label],
            ingest=cfg.ingest,
            seed=cfg.train.seed,
        )

    def device_steps(self) -> str | None:
        """Which steps the training workers run on their device, per split (None: none do)."""
        return "; ".join(f"{split}: {', '.join(steps)}" for split, steps in self.on_device.items() if steps) or None

    def reads(self) -> str | None:
        """Where the streamed splits were read so far, each node's share of the bytes, and what the gathering tasks
        fetched from other nodes' stores, per node (None: nothing streamed or fetched)."""
        by_node, received = ray.get(self.coordinator.reads.remote())
        total = sum(by_node.values())
        if not total and not received:
            return None
        shares = ", ".join(f"{node[:8]} {size / total:.0%}" for node, size in sorted(by_node.items()))
        fetched = ", ".join(f"{node[:8]} {size / 2**20:,.1f} MiB" for node, size in sorted(received.items()))
        return f"{total / 2**20:,.0f} MiB read on {len(by_node)} node(s): {shares}; fetched from other nodes: " + (
            fetched or "none"
        )


@dataclass(frozen=True, kw_only=True)
class Mixing:
    """How well the training split's windows mix it: ``share`` of the labels a full shuffle mixes that a window
    can hold, bounded from the row groups' label ranges in the parquet footers (1.0: as a full shuffle)."""

    windows: int
    groups: tuple[int, int]  # fewest and most row groups a window holds
    rows_per_group: int
    share: float
    shuffled: bool  # ingest.shuffle: without it a batch takes consecutive rows, as if each row group were a window

    def summary(self) -> str:
        low, high = self.groups
        held = f"{low}" if low == high else f"{low}-{high}"
        layout = f"row groups of about {self.rows_per_group:,} rows"
        read = f"{self.windows} window(s) of {held} {layout}" if self.shuffled else f"stored order ({layout})"
        return (
            f"{read}; a window holds at most {self.share:.0%} of the labels a full shuffle mixes (the footers' label "
            "ranges)"
        )

    def warning(self) -> str | None:
        """What to do when the windows are too coarse to mix a split that looks sorted by label."""
        if self.share >= MIX_WARNING:
            return None
        remedy = (
            "Rewrite it once, shuffled, in smaller row groups: python -m pipeline.reshuffle SOURCE TARGET "
            "(docs/own-data.md, 'Data stored by class'), or give the stream larger windows (ingest.cache_share, a "
            "larger object store, more preprocessing nodes)."
            if self.shuffled
            else "Turn the shuffle on: ingest.shuffle=true."
        )
        return (
            f"ingest: the training split looks sorted by label and is read in {self.summary()}: its batches "
            f"cannot mix its labels as a shuffle would, and the model may learn little. {remedy}"
        )


def start_coordinator() -> Any:
    """The job's coordinator, on this process's node: it starts the streams' readers, and goes with the job."""
    return Coordinator.options(**on_this_node()).remote()


def training_data(cfg: PipelineConfig, splits: dict[str, source.Split], plan: CachePlan | None = None) -> TrainingData:
    """Each split read lazily with its transforms chained on (the training split shuffled, with
    ``ingest.shuffle``). With the cache on (``plan``, else decided here), each split's steps that run
    once are submitted now, as Ray tasks, and training reads their output as it comes; a split that is not
    cached is streamed (:mod:`pipeline.data.stream`), its first window read now. Only ``ingest.standardize``
    waits, for its pass over the training split: a transform that fails there fails the job here, in one line
    naming the cause. Use it as a context manager: leaving the ``with`` block ends the job's coordinator."""
    src, ingest = cfg.source, cfg.ingest
    layout = splits["train"].layout
    columns = [layout.model_input, layout.label]
    seed = cfg.train.seed if ingest.shuffle else None
    plan = plan or cache_plan(cfg, splits)
    one_node = len(alive_nodes()) == 1
    data = TrainingData(
        datasets={},
        rows={name: split.rows for name, split in splits.items()},
        coordinator=start_coordinator(),
        plan=plan,
    )
    try:
        for name, split in splits.items():
            shuffle = seed if name == "train" else None
            groups = pieces.row_groups(split.files, split.filesystem, src.limit, layout.label)
            every_epoch = cached_steps(split.steps)[1] if plan.on else streamed_steps(split.steps)
            # a cache the workers can read themselves (not where its pieces may sit on other nodes; nor with
            # ingest.standardize, whose pass over the split reads its rows): on_device auto sends the per-epoch
            # steps to them, on any device, and with nothing left to run in Ray Data's tasks they gather the rows
            readable = plan.on and one_node and not ingest.standardize
            in_tasks, data.on_device[name] = device_split(every_epoch, cfg.scaling.use_gpu or readable)
            indexed = readable and not in_tasks
            if plan.on:
                built = data.caches[name] = cached_split(split, groups, columns, shuffle, plan.row_bytes[name])
                if indexed:
                    numbers = pieces.row_numbers(groups) if name == "train" else None
                    data.indexed[name] = cache.Indexed(cache=built, rows=split.rows, numbers=numbers)
                elif ingest.engine == IngestEngine.ray_data:
                    parts = epochs.numpy_parts(
                        [[built.pieces[i] for i in piece] for piece in built.by_group],
                        [group.rows for group in groups],
                        [round(group.rows * plan.row_bytes[name]) for group in groups],
                    )
                    _, every_epoch = cached_steps(split.steps)
                    data.datasets[name], tasks = read_epochs(
                        parts,
                        every_epoch,
                        [],
                        columns,
                        cfg,
                        epoch_actor=data.coordinator,
                        seed=shuffle,
                        numbers=pieces.row_numbers(groups) if name == "train" else None,
                        on_device=data.on_device[name],
                        where=read_placement(every_epoch),
                    )
                else:
                    data.datasets[name] = cached_dataset(
                        split,
                        built,
                        groups,
                        columns,
                        data.coordinator,
                        name=name,
                        on_device=data.on_device[name],
                        numbered=name == "train",
                    )
            elif ingest.engine == IngestEngine.ray_data:
                parts = epochs.row_groups(groups, split.filesystem, [*split.layout.inputs, *columns[1:]])
                data.datasets[name], tasks = read_epochs(
                    parts,
                    streamed_steps(split.steps),
                    read_steps(split),
                    columns,
                    cfg,
                    epoch_actor=data.coordinator,
                    seed=shuffle,
                    numbers=pieces.row_numbers(groups) if name == "train" else None,
                    on_device=data.on_device[name],
                    where=read_placement(split.steps),
                )
            else:
                streaming = streamed_dataset(
                    split,
                    name,
                    groups,
                    columns,
                    coordinator=data.coordinator,
                    shuffle_seed=shuffle,
                    budget=plan.capacity_bytes // 3,
                    on_device=data.on_device[name],
                    numbered=name == "train",
                )
                data.datasets[name], data.streams[name] = streaming
            if name == "train":
                if indexed or ingest.engine == IngestEngine.pieces:
                    windows = (data.caches.get(name) or data.streams[name]).windows.later
                    homes = 1 if indexed else len(placeable_nodes(read_placement(split.steps))) or 1
                else:
                    windows, homes = tasks, 1
                data.mixing = mixing(groups, windows, shuffle, layout, cfg, homes)
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


def mixing(
    groups: list[pieces.RowGroup],
    windows: int,
    seed: int | None,
    layout: source.Layout,
    cfg: PipelineConfig,
    homes: int = 1,
) -> Mixing | None:
    """How the training split's steady-state windows mix its labels (:func:`pipeline.data.pieces.mix`), each window's
    rows mixed within the share of each of the ``homes`` nodes that hold it (:mod:`pipeline.data.pieces`): as
    ``windows * homes`` windows; unshuffled, a batch takes consecutive rows, as if each row group were a window.
    None where the footers have no label ranges."""
    windows = min(len(groups), windows * homes) if seed is not None else len(groups)
    values = None  # a regression's numbers: the share of their range
    if cfg.task.type == "classification":  # the labels as stored: class names, or their indices
        values = layout.classes or list(range(cfg.source.num_classes or 0)) or None
    share = pieces.mix(groups, windows, seed, values)
    if share is None:
        return None
    sizes = [len(w) for w in pieces.window_groups(len(groups), seed, 0, windows)]
    rows = round(sum(group.rows for group in groups) / max(len(groups), 1))
    return Mixing(
        windows=windows, groups=(min(sizes), max(sizes)), rows_per_group=rows, share=share, shuffled=seed is not None
    )


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
    epoch_actor,
    seed: int | None,
    numbers: np.ndarray | None,
    on_device: dict[str, TransformSpec],
    where: dict,
) -> tuple[ray.data.Dataset, int]:
    """A split's ``parts`` read anew every epoch by Ray Data's read tasks (:class:`pipeline.data.epochs.EpochSource`:
    in an order drawn from ``seed`` and the epoch, rows numbered from ``numbers``), ``first`` and ``steps`` (but
    those ``on_device``) run on them by ``map_batches`` tasks placed as ``where`` says (fused with the reads), in
    blocks of one worker's batch; with it, how many read tasks an epoch has."""
    block_rows = max(1, cfg.ingest.batch_size // cfg.scaling.max_workers)
    cpus = sum(node["Resources"].get("CPU", 0) for node in placeable_nodes(where)) or 1
    tasks = epochs.epoch_tasks(parts, int(cpus))
    read = epochs.EpochSource(parts, epochs=epoch_actor, seed=seed, numbers=numbers, tasks=tasks, block_rows=block_rows)
    then = Steps({n: s for n, s in steps.items() if n not in on_device}, first, keep=columns)
    options = {"num_cpus": max((s.num_cpus for s in steps.values()), default=1.0), **where}
    ds = ray.data.read_datasource(read, override_num_blocks=read.tasks, **where)  # no SplitBlocks: fused with the steps
    # the steps take each block as read (a batch of a size would keep them apart from the read), and their output
    # leaves in blocks of one worker's batch
    ds = ds.map_batches(then, batch_size=None, **options).repartition(target_num_rows_per_block=block_rows)
    return workarounds.streamed_blocks(ds), read.tasks


def streamed_dataset(
    split: source.Split,
    name: str,
    groups: list[pieces.RowGroup],
    columns: list[str],
    *,
    coordinator,
    shuffle_seed: int | None,
    budget: int,
    on_device: dict[str, TransformSpec] | None = None,
    numbered: bool = False,
) -> tuple[ray.data.Dataset, stream.Stream]:
    """``split`` (called ``name``, its row ``groups``) read anew every epoch (:mod:`pipeline.data.stream`), in a
    new order drawn from ``shuffle_seed`` (None: the stored order), windows of at most ``budget`` bytes at a
    time read by a reader on each node where the split's first step may run, every step but those ``on_device``
    (the training workers run them) run as its rows are gathered.
    ``columns`` as :func:`dataset`'s; ``numbered``: as :func:`epoch_dataset`'s."""
    steps, where = streamed_steps(split.steps), read_placement(split.steps)
    steps = {name: spec for name, spec in steps.items() if name not in (on_device or {})}
    columns_read = [*split.layout.inputs, *columns[1:]]
    streaming = stream.open_stream(
        coordinator,
        name,
        groups,
        filesystem=split.filesystem,
        columns=columns_read,
        seed=shuffle_seed,
        budget=budget,
        where=where,
    )
    numbers = pieces.row_numbers(groups) if numbered else None
    epochs = epoch_dataset(
        streaming, shuffle_seed, steps, read_steps(split), columns, coordinator, name=name, where=where, numbers=numbers
    )
    return epochs, streaming


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


def cached_dataset(
    split: source.Split,
    built: cache.Cache,
    groups: list[pieces.RowGroup],
    columns: list[str],
    coordinator,
    *,
    name: str,
    on_device: dict[str, TransformSpec] | None = None,
    numbered: bool = False,
) -> ray.data.Dataset:
    """A lazy dataset that reads ``split``'s cache (``built`` from its row ``groups``; ``name``: the split's) each
    epoch, mixed with the
    cache's seed, with the per-epoch steps but those ``on_device`` (the training workers run them) chained on.
    ``columns`` as :func:`dataset`'s; ``numbered``: as :func:`epoch_dataset`'s."""
    _, every_epoch = cached_steps(split.steps)
    where = read_placement(every_epoch)  # the gathering tasks run where the per-epoch steps would
    every_epoch = {name: spec for name, spec in every_epoch.items() if name not in (on_device or {})}
    numbers = pieces.row_numbers(groups) if numbered else None
    return epoch_dataset(
        built, built.seed, every_epoch, [], columns, coordinator, name=name, where=where, numbers=numbers
    )


def epoch_dataset(
    source: pieces.Source,
    seed: int | None,
    steps: dict[str, TransformSpec],
    first: list,
    columns,
    coordinator,
    *,
    name: str,
    where: dict,
    numbers: np.ndarray | None = None,
):
    """Each epoch of split ``name`` gathered from ``source``'s pieces (:func:`pipeline.data.pieces.dataset`) by tasks
    placed as ``where`` says (:func:`pipeline.data.steps.placement`), ``first`` (:func:`read_steps`) and ``steps`` run
    on the rows as they are gathered, in the same task, which keeps only ``columns``; with ``numbers`` (the training
    split's), each row's number as well, and a resumed epoch without the rows trained on before the stop."""
    then = Steps(steps, first, keep=columns)
    options = {"num_cpus": max((s.num_cpus for s in steps.values()), default=1.0), **where}
    return pieces.dataset(
        source,
        source.windows,
        source.tasks,
        name=name,
        seed=seed,
        then=then,
        coordinator=coordinator,
        options=options,
        numbers=numbers,
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
