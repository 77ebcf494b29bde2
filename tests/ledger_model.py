"""A model for the preemption tests that keeps a ledger: each training forward appends the row numbers it saw
(the first feature column holds each row's number) to a file per process, each validation pass a ``V``, so a test
can tell, epoch by epoch, which rows every step trained on. ``delay_s`` slows each step, so a stop lands mid-epoch;
``valid_delay_s`` each validation batch, so that one lands in validation.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch


class LedgerModel(torch.nn.Module):
    def __init__(
        self, in_channels: int, num_classes: int, log_dir: str, delay_s: float = 0.0, valid_delay_s: float = 0.0
    ):
        super().__init__()
        self.linear = torch.nn.Linear(in_channels - 1, num_classes)
        self.log_dir, self.delay_s, self.valid_delay_s = log_dir, delay_s, valid_delay_s
        self.validating = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with open(Path(self.log_dir) / f"{os.getpid()}.log", "a") as out:
            if self.training:
                out.write("T " + " ".join(str(int(v)) for v in x[:, 0].round().tolist()) + "\n")
                self.validating = False
            elif not self.validating:
                out.write("V\n")
                self.validating = True
        time.sleep(self.delay_s if self.training else self.valid_delay_s)
        return self.linear(x[:, 1:])


def passthrough(batch: dict) -> dict:
    """A transform step that changes nothing: placed on the preprocessing nodes, it puts a split's reads there."""
    return batch
