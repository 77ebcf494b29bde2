"""The benchmarks' models: cheap enough that feeding them is the bound.

:class:`LinearProbe` (``bench/ingest.py``) is a linear classifier on every ``stride``-th pixel, taking uint8 images
as the pipeline hands them over with ``ingest.normalize=null`` (on a GPU node, scaling pixels is the GPU's work, not
the data CPUs'). :class:`Bias` (``bench/feed.py``) reads nothing of its batch but its length: an epoch's time is the
feed's.
"""

from __future__ import annotations

import torch


class LinearProbe(torch.nn.Module):
    def __init__(self, size: int, stride: int, num_classes: int, channels: int = 3):
        super().__init__()
        self.stride = stride
        self.linear = torch.nn.Linear(channels * len(range(0, size, stride)) ** 2, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        pixels = images[:, :, :: self.stride, :: self.stride].flatten(1).float().mul_(1 / 255)
        return self.linear(pixels)


class Bias(torch.nn.Module):
    """A bias per class, the same for every image: something for the optimizer to step, and nothing to compute."""

    def __init__(self, num_classes: int):
        super().__init__()
        self.bias = torch.nn.Parameter(torch.zeros(num_classes))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.bias.expand(len(images), -1)
