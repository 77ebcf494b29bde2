"""Every metric a run reports, declared once: how a batch adds to it, how an epoch's value comes from
its sum over rows, and which way is better. The workers sum and finish with these, the driver's
checks, tracker, console, checkpoints, sweeps and Tune all read them.

Every metric is a sum over rows divided by the row count (``rmse`` then takes a square root), so
workers add up their shards' sums and every world size reports the same numbers. Importing this
module loads no torch: a batch's sum is written with tensor methods only, so the driver's config
checks read the declarations without it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Metric:
    lower_is_better: bool
    # (outputs, labels) -> the batch's sum over its rows, a tensor on the device; None: not a task metric
    batch_sum: Callable[[Any, Any], Any] | None = None
    finish: Callable[[float], float] = float  # the epoch's value from its mean over rows

    def value(self, total: float, count: int) -> float:
        """The metric from its sum over ``count`` rows."""
        return self.finish(total / max(count, 1))


def top_k(k: int) -> Callable[[Any, Any], Any]:
    """Rows whose label is among the ``k`` highest-scoring classes."""

    def batch_sum(outputs, labels):
        top = outputs.topk(min(k, outputs.shape[1]), dim=1).indices
        return (top == labels[:, None]).any(dim=1).sum()

    return batch_sum


def absolute_error(outputs, labels):
    return (outputs - labels).abs().sum()


def squared_error(outputs, labels):
    return ((outputs - labels) ** 2).sum()


# What an epoch reports besides the task's metrics: the losses (means over rows); the rows that reached
# the training loop, all workers together; its throughput; the share of its time spent waiting for a batch.
LOSSES = {"train_loss": Metric(lower_is_better=True), "val_loss": Metric(lower_is_better=True)}
COUNTERS = {
    "train_throughput": Metric(lower_is_better=False),
    "train_rows": Metric(lower_is_better=False),
    # the training rows of the epoch trained on, each counted once by its number (the ledger): train_rows unless a
    # row was trained twice
    "train_rows_distinct": Metric(lower_is_better=False),
    "val_rows": Metric(lower_is_better=False),
    "data_wait_fraction": Metric(lower_is_better=True),
    "skipped_steps": Metric(lower_is_better=True),  # optimizer steps not taken for NaN/inf (train.on_nonfinite)
    "workers": Metric(lower_is_better=False),  # the worker group's size (elastic scaling.num_workers changes it)
    # a worker's parameters and optimizer state (rank 0's: with scaling.strategy=fsdp, its shards)
    "param_bytes": Metric(lower_is_better=True),
    "optimizer_bytes": Metric(lower_is_better=True),
    "micro_batch": Metric(lower_is_better=False),  # rows per forward and backward (train.micro_batch)
    "checkpoint_stall_s": Metric(lower_is_better=True),  # what the previous epoch's checkpoint held training up
    # a worker's peak memory (rank 0's): the GPU's allocated bytes, or on CPU the process's peak resident size
    "peak_memory_bytes": Metric(lower_is_better=True),
}
# a classification's labels per training batch against a full shuffle's (1: as mixed; docs/own-data.md)
MIXING = {"label_mix": Metric(lower_is_better=False)}
# The metrics a task type can declare (task.metrics); a classification also takes topK_accuracy, any K.
REGRESSION = {
    "mae": Metric(True, absolute_error),
    "mse": Metric(True, squared_error),
    "rmse": Metric(True, squared_error, math.sqrt),
}
TASK_CHOICES = {"classification": "accuracy, topK_accuracy (any K, e.g. top5_accuracy)", "regression": "mae, mse, rmse"}


def task_metric(task_type: str, name: str) -> Metric | None:
    """The declaration of a task's metric ``name`` (without ``val_``), or None if the task has no such metric."""
    if task_type == "regression":
        return REGRESSION.get(name)
    if task_type != "classification":
        return None
    if name == "accuracy":
        return Metric(False, top_k(1))
    k = re.fullmatch(r"top([1-9][0-9]*)_accuracy", name)
    return Metric(False, top_k(int(k.group(1)))) if k else None


def epoch_metrics(task_type: str, names: list[str], other: str | None = None) -> dict[str, Metric]:
    """What every epoch of a run reports, in the order the console and MLflow show it: the losses, each
    of the task's metrics ``names`` (``task.metrics``) as ``val_<name>``, the counters (a classification's
    with its ``label_mix``); with ``train.ema``, the validation scores of the ``other`` weights
    (:meth:`pipeline.config.TrainConfig.other_weights`) as ``<other>_val_<name>``."""
    declared = {f"val_{name}": task_metric(task_type, name) for name in names}
    scored = {**LOSSES, **declared}
    others = {f"{other}_{key}": scored[key] for key in scored if key.startswith("val_")} if other else {}
    return {**scored, **others, **COUNTERS, **(MIXING if task_type == "classification" else {})}


def first_task_metric(names: list[str]) -> str:
    """The task's first validation metric (of ``task.metrics``): the learning curve plots it beside the losses."""
    return f"val_{names[0]}"


def is_task_metric(key: str) -> bool:
    """``val_accuracy``, ``val_mae``, ...: a validation metric of the task, not a loss or a row count."""
    return key.startswith("val_") and key not in LOSSES and key not in COUNTERS


def lower_is_better(task_type: str, names: list[str], metric: str) -> bool:
    """Losses, errors and waiting improve downwards; accuracies, rows and throughput upwards."""
    return epoch_metrics(task_type, names, metric.partition("_val_")[0] or None)[metric].lower_is_better
