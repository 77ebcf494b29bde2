"""The benchmark's model: cheap enough that feeding it is the bound (``bench/ingest.py``).

A linear classifier on every ``stride``-th pixel, taking uint8 images as the pipeline hands them over
with ``ingest.normalize=null`` (on a GPU node, scaling pixels is the GPU's work, not the data CPUs').
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
