"""Runs in every training worker: what an epoch measures, gathered in one object so the worker's loop reads
as training. Sums stay on the training device (a ``.item()`` per step would stall a GPU on every batch) and
are all-reduced once, at the end of the epoch, so every rank reports the same figures.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist

from pipeline.common.metrics import LOSSES
from pipeline.training.parallel import world_size


class EpochTelemetry:
    """One epoch's loss, rows, throughput, data wait, skipped optimizer steps and first non-finite batch."""

    def __init__(self, device: torch.device):
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        self.loss_rows = torch.zeros((), device=device)
        self.first_nonfinite = torch.zeros((), dtype=torch.long, device=device)  # its batch number; 0: none
        self.device, self.rows, self.skipped, self.waited = device, 0, 0, 0.0
        self.started = time.perf_counter()

    def timed(self, batches: Iterable) -> Iterator:
        """``batches``, the seconds spent waiting for each added to ``waited``: is ingest the bottleneck?"""
        iterator = iter(batches)
        while True:
            before = time.perf_counter()
            batch = next(iterator, None)
            self.waited += time.perf_counter() - before
            if batch is None:
                return
            yield batch

    def batch(self, step: int, loss: torch.Tensor, rows: int) -> None:
        """A training batch's loss over ``rows`` rows; a NaN or inf loss stays out of the sum, and the first
        such batch is remembered (read once, at the end: :meth:`nonfinite_batch`)."""
        finite = torch.isfinite(loss.detach())
        self.loss_sum += torch.where(finite, loss.detach().double() * rows, 0.0)
        self.loss_rows += finite * rows
        self.first_nonfinite = torch.where((self.first_nonfinite == 0) & ~finite, step, self.first_nonfinite)
        self.rows += rows

    def nonfinite_batch(self) -> int:
        """The first batch whose loss was NaN or inf (1-based), 0 when none was: one device sync an epoch."""
        return int(self.first_nonfinite.item())

    def totals(self) -> dict:
        """The epoch's figures over every worker."""
        elapsed = time.perf_counter() - self.started
        loss, loss_rows, rows, waited, ran = sum_over_workers(
            [self.loss_sum.item(), self.loss_rows.item(), self.rows, self.waited, elapsed], self.device
        )
        return {
            "train_loss": LOSSES["train_loss"].value(loss, loss_rows),
            "train_throughput": rows / elapsed,
            "train_rows": int(rows),
            "data_wait_fraction": waited / max(ran, 1e-9),
            "skipped_steps": self.skipped,  # the same on every rank: they all see the all-reduced gradients
            "workers": world_size(),
        }


def sum_over_workers(values: list[float], device: torch.device) -> list[float]:
    """Element-wise sums over every worker (no-op outside a process group)."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor)
    return tensor.tolist()
