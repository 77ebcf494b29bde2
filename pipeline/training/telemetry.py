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
    """One epoch's loss, rows, throughput, data wait, skipped optimizer steps, first non-finite batch and, with
    ``classes`` (a classification's count), how well its batches mixed the labels."""

    def __init__(self, device: torch.device, classes: int | None = None):
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        self.loss_rows = torch.zeros((), device=device)
        self.first_nonfinite = torch.zeros((), dtype=torch.long, device=device)  # its batch number; 0: none
        self.device, self.rows, self.skipped, self.waited, self.batches = device, 0, 0, 0.0, 0
        self.labels = torch.zeros(classes, dtype=torch.float64, device=device) if classes else None  # rows of each
        self.distinct = torch.zeros((), dtype=torch.float64, device=device)  # labels per batch, summed
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
        self.batches += 1

    def batch_labels(self, labels: torch.Tensor) -> None:
        """A training batch's labels: how many distinct ones it held, and each one's rows (no device sync)."""
        if self.labels is not None:
            counts = torch.zeros_like(self.labels).index_add_(
                0, labels.long(), torch.ones_like(labels, dtype=torch.float64)
            )
            self.labels += counts
            self.distinct += (counts > 0).sum()

    def nonfinite_batch(self) -> int:
        """The first batch whose loss was NaN or inf (1-based), 0 when none was: one device sync an epoch."""
        return int(self.first_nonfinite.item())

    def summed(self) -> tuple[float, dict]:
        """This worker's seconds so far, and the epoch's sums so far over every worker (a collective)."""
        elapsed = time.perf_counter() - self.started
        labels = self.labels.tolist() if self.labels is not None else []
        loss, loss_rows, rows, waited, ran, batches, distinct, *labels = sum_over_workers(
            [self.loss_sum.item(), self.loss_rows.item(), self.rows, self.waited, elapsed, self.batches]
            + [self.distinct.item(), *labels],
            self.device,
        )
        sums = {"loss": loss, "loss_rows": loss_rows, "rows": rows, "waited": waited, "ran": ran, "batches": batches}
        return elapsed, sums | {"distinct": distinct, "labels": labels}

    def carried(self) -> dict:
        """The epoch's sums so far (a collective), for a checkpoint within it: a resumed epoch's figures are
        the whole epoch's (:meth:`resume`)."""
        _, sums = self.summed()
        return sums | {"skipped": self.skipped, "workers": world_size()}

    def resume(self, carried: dict, rank: int) -> None:
        """Continue an epoch from a checkpoint within it: rank 0 adds the sums so far (counted once over the
        workers), and every rank's clock starts as far back as a worker had trained."""
        self.started -= carried["ran"] / carried["workers"]
        self.skipped += carried["skipped"]
        if rank != 0:
            return
        self.loss_sum += carried["loss"]
        self.loss_rows += carried["loss_rows"]
        self.rows += int(carried["rows"])
        self.waited += carried["waited"]
        self.batches += int(carried["batches"])
        self.distinct += carried["distinct"]
        if self.labels is not None:
            self.labels += torch.tensor(carried["labels"], dtype=torch.float64, device=self.device)

    def totals(self) -> dict:
        """The epoch's figures over every worker."""
        elapsed, sums = self.summed()
        loss, loss_rows, rows, waited, ran = (sums[key] for key in ("loss", "loss_rows", "rows", "waited", "ran"))
        batches, distinct, labels = sums["batches"], sums["distinct"], sums["labels"]
        figures = {
            "train_loss": LOSSES["train_loss"].value(loss, loss_rows),
            "train_throughput": rows / elapsed,
            "train_rows": int(rows),
            "data_wait_fraction": waited / max(ran, 1e-9),
            "skipped_steps": self.skipped,  # the same on every rank: they all see the all-reduced gradients
            "workers": world_size(),
        }
        if labels and batches:
            figures["label_mix"] = label_mix(labels, distinct / batches, rows / batches)
        return figures


def label_mix(rows_per_label: list[float], distinct_per_batch: float, batch_rows: float) -> float:
    """Labels per batch against a full shuffle's: a batch of ``batch_rows`` rows drawn at random from the epoch's
    rows holds on average sum(1 - (1 - p)^batch_rows) distinct labels (p: each label's share). 1: as mixed as a
    full shuffle; 1 / labels: every batch of one label (a split read in class order)."""
    total = sum(rows_per_label)
    expected = sum(1 - (1 - n / total) ** batch_rows for n in rows_per_label)
    return distinct_per_batch / max(expected, 1e-9)


def sum_over_workers(values: list[float], device: torch.device) -> list[float]:
    """Element-wise sums over every worker (no-op outside a process group)."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor)
    return tensor.tolist()
