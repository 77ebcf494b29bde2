"""How well an epoch mixes the training split (driver side, before training): what its read tasks and the workers'
shuffle buffers can hold of its labels, bounded from the parquet footers' label ranges (:class:`Mixing`, said on the
console and tagged on the run), and each worker's shuffle buffer (``ingest.local_shuffle_buffer_size``), sized to the
fewest rows that mix as the most the object store allows."""

from __future__ import annotations

import math
from dataclasses import dataclass

from pipeline.config import Layout, PipelineConfig, TransformSpec
from pipeline.data import pieces, source
from pipeline.data.cache_plan import sample_rows
from pipeline.runtime.cluster import alive_nodes

MIX_WARNING = 0.9  # a training split whose read tasks hold less of its labels than this (of a full shuffle's) warns
SHUFFLE_SHARE = 0.25  # of the smallest object store, the training workers' shuffle buffers together (ingest.*buffer*)
FULL_MIX = 0.99  # a share of the labels (of a full shuffle's) that mixes as a full shuffle does
FEWEST_BATCHES = 8  # the smallest auto shuffle buffer, in a worker's batches: batches new every epoch, a short fill


@dataclass(frozen=True, kw_only=True)
class Mixing:
    """How well an epoch mixes the training split: each of its ``tasks`` read tasks mixes the row groups it reads
    (``groups``: fewest and most), and ``share`` is how much of the labels a full shuffle mixes such a task can hold,
    bounded from the row groups' label ranges in the parquet footers (1.0: as a full shuffle)."""

    tasks: int
    groups: tuple[int, int]  # fewest and most row groups a read task holds
    rows_per_group: int
    share: float
    shuffled: bool  # ingest.shuffle: without it a batch takes consecutive rows, as if each row group were a task's
    buffer: int | None = None  # rows each worker's shuffle buffer draws its batches from
    whole: bool = False  # the buffers hold the whole split: a full shuffle

    def summary(self) -> str:
        low, high = self.groups
        held = f"{low}" if low == high else f"{low}-{high}"
        layout = f"row groups of about {self.rows_per_group:,} rows"
        read = f"{self.tasks} read task(s) of {held} {layout}" if self.shuffled else f"stored order ({layout})"
        if self.buffer:
            whole = ", the whole split: a full shuffle" if self.whole else ""
            read += f", each worker drawing its batches from a shuffle buffer of {self.buffer:,} rows{whole}"
        return (
            f"{read}; a batch draws on at most {self.share:.0%} of the labels a full shuffle mixes (the footers' "
            "label ranges)"
        )

    def warning(self) -> str | None:
        """What to do when the read tasks are too small to mix a split that looks sorted by label."""
        if self.share >= MIX_WARNING:
            return None
        remedy = (
            "Rewrite it once, shuffled, in smaller row groups: python -m pipeline.reshuffle SOURCE TARGET "
            "(docs/own-data.md, 'Data stored by class'), let each read task mix more (ingest.read_task_mib), or give "
            "each worker a larger shuffle buffer (ingest.local_shuffle_buffer_size, rows; or a larger object store)."
            if self.shuffled
            else "Turn the shuffle on: ingest.shuffle=true."
        )
        return (
            f"ingest: the training split looks sorted by label and is read in {self.summary()}: its batches "
            f"cannot mix its labels as a shuffle would, and the model may learn little. {remedy}"
        )


def mixing(
    groups: list[pieces.RowGroup],
    tasks: int,
    seed: int | None,
    layout: Layout,
    cfg: PipelineConfig,
    *,
    buffer: int | None = None,
) -> Mixing | None:
    """How an epoch's ``tasks`` read tasks mix the training split's labels (:func:`pipeline.data.pieces.mix`), each
    mixing the rows of its row groups, and each worker's shuffle ``buffer`` (rows) the rows of the tasks it spans;
    unshuffled, a batch takes consecutive rows, as if each row group were a task's. None where the footers have no
    label ranges."""
    tasks = min(len(groups), tasks) if seed is not None else len(groups)
    values = None  # a regression's numbers: the share of their range
    if cfg.task.type == "classification":  # the labels as stored: class names, or their indices
        values = layout.classes or list(range(cfg.source.num_classes or 0)) or None
    total = sum(group.rows for group in groups)
    spanned = buffer * cfg.scaling.max_workers / (total / tasks) if buffer and seed is not None else 1.0
    windows = max(1, math.ceil(tasks / max(spanned, 1.0)))  # the workers' buffers draw from this many tasks' rows
    share = pieces.mix(groups, windows, seed, values)
    if share is None:
        return None
    sizes = [len(w) for w in pieces.window_groups(len(groups), seed, 0, tasks)]
    return Mixing(
        tasks=tasks,
        groups=(min(sizes), max(sizes)),
        rows_per_group=round(total / max(len(groups), 1)),
        share=share,
        shuffled=seed is not None,
        buffer=buffer if seed is not None else None,
        whole=bool(buffer) and buffer * cfg.scaling.max_workers >= total,
    )


def shuffle_rows(
    cfg: PipelineConfig, split: source.Split, steps: dict[str, TransformSpec], groups: list[pieces.RowGroup]
) -> int | None:
    """Each training worker's shuffle buffer (``ingest.local_shuffle_buffer_size``), in rows. ``auto``: the fewest
    rows that mix the labels as well as the most the store allows (:func:`enough_rows`): what ``SHUFFLE_SHARE`` of
    the smallest object store holds, shared among the workers, at the bytes a row takes as it reaches them (the first
    rows through ``steps``, those run before: none where the read tasks hand on the stored rows), up to a worker's
    share of the split. A split stored by class: on one node most often whole, a full shuffle, as a DataLoader's; one
    stored mixed, a few batches, so that an epoch's first batch waits for a few batches' rows, not for the split.
    None without ``ingest.shuffle``: the stored order."""
    setting = cfg.ingest.local_shuffle_buffer_size
    if setting != "auto":
        return setting
    if not cfg.ingest.shuffle:
        return None
    sample = sample_rows(split, steps)
    row_bytes = pieces.batch_bytes(sample) / max(len(sample[split.layout.label]), 1)
    workers = cfg.scaling.max_workers
    store = min(node["Resources"].get("object_store_memory", 0.0) for node in alive_nodes())
    most = max(1, min(split.rows // workers, int(SHUFFLE_SHARE * store / workers / row_bytes)))
    return enough_rows(most, groups, split.layout, cfg)


def enough_rows(most: int, groups: list[pieces.RowGroup], layout: Layout, cfg: PipelineConfig) -> int:
    """The first of ``FEWEST_BATCHES`` of a worker's batches, doubled, up to ``most`` rows, whose buffers mix the
    labels as ``most`` rows do (within 1%, by the footers' label ranges: :func:`mixing`, each row group counted a read
    task, so a buffer spans the fewest rows); ``most`` where the footers cannot tell."""
    seed = cfg.train.seed
    best = mixing(groups, len(groups), seed, layout, cfg, buffer=most)
    rows = FEWEST_BATCHES * max(1, cfg.ingest.batch_size // cfg.scaling.max_workers)
    while best is not None and rows < most:
        if mixing(groups, len(groups), seed, layout, cfg, buffer=rows).share >= 0.99 * best.share:
            return rows
        rows *= 2
    return most


def buffers_mix(groups: list[pieces.RowGroup], split: source.Split, buffer: int | None, cfg: PipelineConfig) -> bool:
    """Whether the training workers' shuffle buffers of ``buffer`` rows mix the labels as a full shuffle does: they
    hold the whole ``split``, or any span of ``buffer`` rows holds nearly every label (rows stored mixed, by
    the footers' label ranges). Then the read tasks hand on their rows in the stored order, not copied into a mixed
    one."""
    if not buffer:
        return False
    if buffer * cfg.scaling.max_workers >= split.rows:
        return True
    mixed = mixing(groups, len(groups), cfg.train.seed, split.layout, cfg, buffer=buffer)
    return mixed is not None and mixed.share >= FULL_MIX
