"""A model for the micro-batch tests whose process has a memory cap: a wide MLP (each row's activations 16 MB),
and from its first training forward an address-space limit (``RLIMIT_AS``) of ``cap_mb`` above what the process
maps then, so a batch of many rows fails in the CPU allocator, as a large batch does on a GPU, and a few rows fit.
``cap_mb=None``: no cap (the same model, set by hand). ``fail_epoch``: the first training forward of that epoch
(from 0) fails, so that a test can resume the run."""

from __future__ import annotations

import resource

import torch


def mapped_bytes() -> int:
    """The process's address space now (VmSize)."""
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmSize:"))
    return int(line.split()[1]) * 1024


def cap_memory(cap_mb: float) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (mapped_bytes() + int(cap_mb * 2**20), resource.RLIM_INFINITY))


class WideMLP(torch.nn.Module):
    """Linear, ReLU, each of the ``hidden`` features spread over ``spread`` trained weights and summed back, Linear:
    few weights, and ``4 * hidden * spread`` bytes of activations a row (16 MB by default) in each forward and
    backward, so that a batch's need dwarfs whatever memory its process already holds free."""

    def __init__(
        self,
        in_channels: int,
        num_classes: int,
        hidden: int = 4096,
        spread: int = 1024,
        cap_mb: float | None = None,
        fail_epoch: int | None = None,
    ):
        super().__init__()
        self.first = torch.nn.Linear(in_channels, hidden)
        self.spread = torch.nn.Parameter(torch.full((spread,), 1.0 / spread))
        self.last = torch.nn.Linear(hidden, num_classes)
        self.cap_mb, self.capped = cap_mb, False
        self.fail_epoch, self.epoch, self.validating = fail_epoch, 0, False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.validating:  # the next epoch's first forward
            self.epoch, self.validating = self.epoch + 1, False
            if self.epoch == self.fail_epoch:
                raise RuntimeError(f"the test's failure at the start of epoch {self.epoch + 1}")
        self.validating = not self.training
        if self.training and self.cap_mb is not None and not self.capped:
            cap_memory(self.cap_mb)
            self.capped = True
        hidden = torch.relu(self.first(x))
        return self.last((hidden[:, :, None] * self.spread).sum(-1))
