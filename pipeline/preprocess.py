"""Transforms stage: chain each split's configured transforms onto its dataset as lazy map_batches.

Functions run as stateless Ray tasks; classes run as an actor pool (built once per actor, for
transforms with expensive set-up). Either way they use their own CPUs, not the training workers'.
"""

from __future__ import annotations

import functools

import ray.data
from hydra.utils import instantiate

from pipeline import source
from pipeline.config import active_steps


def apply(ds, specs: dict[str, dict], columns: list[str]):
    """Return ``ds`` with every transform in ``specs`` (name -> TransformSpec dict) appended, in order,
    then only ``columns`` kept (the reader's ``path`` column serves error messages, not training),
    where the last step ran."""
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
            ds = ds.map_batches(fn, compute=ray.data.TaskPoolStrategy(size=spec["concurrency"]), **options)
        last = placement(spec)
    return ds.select_columns(columns, **last)


def dataset(split: source.Split, steps: dict[str, dict], columns: list[str], source_cfg: dict):
    """``split`` read lazily (as ``source.*`` says) with ``steps`` chained on."""
    read = source.read(split, columns, source_cfg, read_placement(steps))
    return apply(read, steps, columns)


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


def start_at_epoch(ds, epoch: int) -> None:
    """Number ``ds``'s next pass ``epoch``. Ray Data counts a dataset's executions (one per epoch under
    Ray Train) and seeded random transforms draw from that count, so a resumed run that continues at
    ``epoch`` augments exactly as an uninterrupted run would. (A worker group restarted within a run
    counts from here again: training goes on, but its augmentation then repeats earlier epochs'.)"""
    ds.context._execution_idx = epoch
