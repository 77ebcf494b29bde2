"""``ingest.cache`` decided on the driver before anything is recorded: each split's cached stage estimated from its
first rows against ``ingest.cache_share`` of the preprocessing nodes' object stores (:func:`cache_plan`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import ray

from pipeline.common.errors import PipelineError
from pipeline.config import PipelineConfig, TransformSpec
from pipeline.data import pieces, source
from pipeline.data.steps import Steps, cached_steps, read_placement, read_steps
from pipeline.runtime.cluster import placeable_nodes


@dataclass(kw_only=True)
class CachePlan:
    """Whether each split's deterministic steps run once, their output kept in Ray's object store, or
    every epoch: the estimate it was decided on and, once built, what the cache holds."""

    on: bool
    estimate_bytes: int  # every split's cached stage, from the first rows of its first file
    capacity_bytes: int  # ingest.cache_share of the object store
    row_bytes: dict[str, float] = field(default_factory=dict)  # split -> estimated bytes a cached row takes
    one_pass: bool = False  # auto with one epoch: each row is read once, so there is nothing to keep

    def summary(self, built: dict[str, dict] | None = None) -> str:
        """One line for the console and the run's ``pipeline.cache`` tag; ``built``: what each cached split
        holds once built (rows, bytes, seconds: :meth:`pipeline.data.cache.Cache.figures`)."""
        share = f"{self.estimate_bytes / 2**20:,.0f} MiB estimated, {self.capacity_bytes / 2**20:,.0f} MiB allowed"
        if not self.on and not self.row_bytes:
            return "not cached (ingest.cache=false): every step runs every epoch"
        if self.one_pass:
            return "not cached (ingest.cache=auto): one epoch reads each row once"
        if not self.on:
            return f"not cached, every step runs every epoch ({share}: ingest.cache, ingest.cache_share)"
        parts = [
            f"{name} {split['rows']:,} rows, {split['bytes'] / 2**20:,.1f} MiB in {split['seconds']:.1f} s"
            for name, split in (built or {}).items()
        ]
        return f"cached in Ray's object store: {'; '.join(parts) or 'building'} ({share})"


SAMPLE_ROWS = 32  # rows of each split's first file run through its cached steps to estimate the cache


def cache_plan(cfg: PipelineConfig, splits: dict[str, source.Split]) -> CachePlan:
    """``ingest.cache`` decided before anything is recorded: the cached stage's size estimated from the
    first rows of each split (run through its once-only steps here, on the driver: a transform that fails
    on them fails here) against ``ingest.cache_share`` of the preprocessing nodes' object stores
    (:func:`store_bytes`). ``auto`` streams what does not
    fit, and a run of one epoch, which reads each row once; ``true`` fails."""
    ingest = cfg.ingest
    capacity = int(store_bytes(read_placement(splits["train"].steps)) * ingest.cache_share)
    if ingest.cache is False:
        return CachePlan(on=False, estimate_bytes=0, capacity_bytes=capacity)
    row_bytes = {}
    for name, split in splits.items():
        once, _ = cached_steps(split.steps)
        try:
            sample = sample_rows(split, once)
        except Exception as err:  # a transform's own error about the user's data: it names the file and row
            raise PipelineError(f"transforms.{name}: {type(err).__name__}: {err}") from err
        row_bytes[name] = pieces.batch_bytes(sample) / max(len(sample["path"]), 1)
    estimate = round(sum(row_bytes[name] * split.rows for name, split in splits.items()))
    if estimate > capacity and ingest.cache is True:
        raise PipelineError(
            f"ingest.cache=true: the cached steps' output is about {estimate / 2**20:,.0f} MiB (estimated from "
            f"the first {SAMPLE_ROWS} rows of each split), more than ingest.cache_share={ingest.cache_share:g} of "
            f"Ray's object store ({capacity / 2**20:,.0f} MiB). Set ingest.cache=auto (streams what does not fit) or "
            "false, cache a smaller working size (the decode step's resize), or give Ray a larger object store "
            "(ray.object_store_memory=BYTES, or ray start --object-store-memory on a cluster)."
        )
    one_pass = ingest.cache == "auto" and cfg.train.epochs == 1
    on = estimate <= capacity and not one_pass
    return CachePlan(on=on, estimate_bytes=estimate, capacity_bytes=capacity, row_bytes=row_bytes, one_pass=one_pass)


def store_bytes(where: dict) -> int:
    """What the object stores of the nodes that preprocess (``where``: the split's first step's placement) hold
    together, as the reads and the cache's tasks fill them, spread over those nodes alike: as many times the
    smallest store as there are such nodes (the whole cluster's, where none matches)."""
    stores = [node["Resources"].get("object_store_memory", 0.0) for node in placeable_nodes(where)]
    return int(len(stores) * min(stores)) if stores else int(ray.cluster_resources().get("object_store_memory", 0))


def sample_rows(split: source.Split, steps: dict[str, TransformSpec]) -> dict[str, np.ndarray]:
    """The first rows of the split's first file as a Ray Data batch would hold them, through ``steps``."""
    layout = split.layout
    reader = pq.ParquetFile(split.files[0], filesystem=split.filesystem)
    table = pa.Table.from_batches([next(reader.iter_batches(SAMPLE_ROWS, columns=[*layout.inputs, layout.label]))])
    return Steps(steps, read_steps(split))(pieces.numpy_batch(table, split.files[0]))
