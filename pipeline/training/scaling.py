"""How features become the model's floats, on the device: pixels normalized, table features standardized.
Training, prediction and the logged models all scale with :func:`feature_scaler`, so they cannot drift."""

from __future__ import annotations

import torch

from pipeline.config import NormalizeConfig


def feature_scaler(normalize: NormalizeConfig | None, statistics: dict | None, device: torch.device):
    """How features become the model's floats, on the device: uint8 pixels as ``normalize`` (``ingest.normalize``)
    says, float features standardized with ``statistics`` (the training split's, with ``ingest.standardize``)
    when given; anything else as it is."""
    pixels = pixel_scaling(normalize, device) if normalize is not None else None
    if statistics is not None:
        mean = torch.tensor(statistics["mean"], dtype=torch.float32, device=device)
        std = torch.tensor(statistics["std"], dtype=torch.float32, device=device)

    def scale(features: torch.Tensor) -> torch.Tensor:
        if features.dtype == torch.uint8 and pixels is not None:  # in place: one float copy, not three
            return features.float().mul_(pixels[0]).add_(pixels[1])
        if statistics is not None and features.is_floating_point():  # a missing value (source.on_missing: mean)
            return torch.nan_to_num((features - mean) / std, nan=0.0)  # becomes the training mean
        return features

    return scale


def pixel_scaling(normalize: NormalizeConfig, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, shift)`` with ``x * scale + shift == (x / 255 - mean) / std``, shaped for (N, C, H, W)."""
    mean = torch.tensor(normalize.mean, dtype=torch.float32, device=device).view(1, -1, 1, 1)
    std = torch.tensor(normalize.std, dtype=torch.float32, device=device).view(1, -1, 1, 1)
    return 1.0 / (255.0 * std), -mean / std
