"""Transforms stage: chain each split's configured transforms onto its dataset as lazy map_batches.

Functions run as stateless Ray tasks; classes run as an actor pool (built once per actor, for
transforms with expensive set-up). Either way they use their own CPUs, not the training workers'.
"""
from __future__ import annotations

import functools

from hydra.utils import instantiate

from pipeline.config import active_steps


def apply(ds, specs: dict[str, dict], columns: list[str]):
    """Return ``ds`` with every transform in ``specs`` (name -> TransformSpec dict) appended, in order,
    then only ``columns`` kept (the reader's ``path`` column serves error messages, not training)."""
    for spec in active_steps(specs).values():
        fn = instantiate(spec["fn"], _partial_=True, _convert_="all")
        options = {"batch_format": "numpy", "batch_size": spec["batch_size"], "num_cpus": spec["num_cpus"]}
        if isinstance(fn, functools.partial) and isinstance(fn.func, type):
            ds = ds.map_batches(
                fn.func, fn_constructor_kwargs=fn.keywords, concurrency=spec["concurrency"] or 1, **options
            )
        else:
            ds = ds.map_batches(fn, **options)
    return ds.select_columns(columns)


def start_at_epoch(ds, epoch: int) -> None:
    """Number ``ds``'s next pass ``epoch``. Ray Data counts a dataset's executions (one per epoch under
    Ray Train) and seeded random transforms draw from that count, so a resumed run that continues at
    ``epoch`` augments exactly as an uninterrupted run would. (A worker group restarted within a run
    counts from here again: training goes on, but its augmentation then repeats earlier epochs'.)"""
    ds.context._execution_idx = epoch
