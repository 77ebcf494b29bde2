"""Runs in every training worker: ``train.early_stop``, the decision and its record. Every rank sees the same
all-reduced metrics, so every rank decides alike; the record travels in each checkpoint, saved and restored
by the same object.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pipeline.common.metrics import lower_is_better
from pipeline.config import PipelineConfig


@dataclass(kw_only=True)
class EarlyStopping:
    """``train.early_stop``: stop once ``metric`` has gone ``patience`` epochs without improving on its
    best by more than ``min_delta``. Its record (best value and epoch) is kept in each checkpoint."""

    metric: str
    patience: int
    min_delta: float
    lower_is_better: bool
    best: float | None = None
    best_epoch: int = -1

    @classmethod
    def of(cls, cfg: PipelineConfig) -> EarlyStopping | None:
        stop, task = cfg.train.early_stop, cfg.task
        if stop.patience is None:
            return None
        metric = stop.metric or cfg.optimized_metric
        lower = lower_is_better(task.type, task.metrics, metric)
        return cls(metric=metric, patience=stop.patience, min_delta=stop.min_delta, lower_is_better=lower)

    def update(self, value: float, epoch: int) -> str | None:
        """Take an epoch's value; why training stops, once patience has run out."""
        gain = (self.best - value if self.lower_is_better else value - self.best) if self.best is not None else math.inf
        if gain > self.min_delta:
            self.best, self.best_epoch = value, epoch
        elif epoch - self.best_epoch >= self.patience:
            return (
                f"{self.metric} did not improve by more than {self.min_delta:g} for {self.patience} epoch(s) "
                f"(best {self.best:.4g} after epoch {self.best_epoch + 1})"
            )
        return None

    def state_dict(self) -> tuple[float | None, int]:
        """What a checkpoint keeps of it: the best value and its epoch."""
        return self.best, self.best_epoch

    def load_state_dict(self, state: tuple[float | None, int] | None) -> None:
        """Continue from a checkpoint's record (none in a checkpoint saved without early stopping)."""
        self.best, self.best_epoch = state if state is not None else (None, -1)
