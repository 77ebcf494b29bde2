"""Runs in every training worker: which rows of the epoch it has trained on, so that a checkpoint taken within an
epoch says where the epoch stands and a resumed run trains on each of its other rows once, on any number of
workers.

Each training batch carries its rows' numbers (:data:`pipeline.data.pieces.ROW`); the ledger counts them on the
training device (no sync per step). At a checkpoint the workers' counts are summed: a row counted once is trained
on, and the epoch's rows packed as bits (a bit a row: 125 KB for a million rows) go in the checkpoint
(:func:`pipeline.training.checkpoint.write_position`), which the resumed epoch's pass leaves out
(:meth:`pipeline.data.feed.Feed.train`).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from pipeline.training.parallel import world_size
from transforms.randomness import ROW


class Ledger:
    """The times each of the split's ``rows`` was trained on this epoch, by this worker (``start``: the rows
    trained on before a resume, counted once over the workers: by rank 0)."""

    def __init__(self, rows: int, device: torch.device, rank: int, start: np.ndarray | None = None):
        self.counts = torch.zeros(rows, dtype=torch.uint8, device=device)
        if start is not None and rank == 0:
            trained = np.unpackbits(start, count=rows).astype(bool)
            self.counts[torch.from_numpy(trained).to(device)] = 1

    def add(self, batch: dict) -> None:
        """A training batch's rows: the optimizer stepped, or will, on them."""
        if ROW in batch:
            self.counts.index_add_(0, batch[ROW].long(), torch.ones_like(batch[ROW], dtype=torch.uint8))

    def gathered(self) -> np.ndarray:
        """Every worker's counts summed (a collective: every rank calls it), as int64."""
        counts = self.counts.int()
        if world_size() > 1:
            dist.all_reduce(counts)
        return counts.cpu().numpy().astype(np.int64)

    def figures(self) -> dict[str, int]:
        """The epoch's rows trained on, each counted once, over every worker (a collective); none for a split whose
        rows carry no numbers."""
        counts = self.gathered()
        return {"train_rows_distinct": int((counts > 0).sum())} if counts.any() else {}

    def trained(self) -> np.ndarray:
        """The rows trained on so far, over every worker, packed as bits (a collective)."""
        return np.packbits(self.gathered() > 0)
