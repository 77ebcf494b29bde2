"""Mixed precision: whether autocast runs, in which dtype, and whether a GradScaler scales the loss."""

from __future__ import annotations

import torch

from pipeline.config import TrainConfig


def amp_plan(device_type: str, train: TrainConfig) -> tuple[bool, torch.dtype, bool]:
    """(autocast on?, its dtype, GradScaler on?): mixed precision only on CUDA and only when asked;
    float16 needs loss scaling, bfloat16 does not."""
    enabled = train.amp and device_type == "cuda"
    dtype = getattr(torch, train.amp_dtype)
    return enabled, dtype, enabled and dtype == torch.float16


def autocast_settings(device: torch.device, train: TrainConfig) -> tuple[torch.autocast, torch.amp.GradScaler]:
    """The autocast context and GradScaler that :func:`amp_plan` asks for."""
    enabled, dtype, scale = amp_plan(device.type, train)
    return torch.autocast(device.type, dtype=dtype, enabled=enabled), torch.amp.GradScaler(device.type, enabled=scale)
