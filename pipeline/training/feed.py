"""Runs in every training worker: each split's shard as batches on the training device, the split's device steps
applied (:mod:`transforms.device`: the steps that run every epoch, on a GPU when the workers have one; which ones is
the driver's :func:`pipeline.data.steps.device_split`).

Batches come from Ray Data's ``iter_torch_batches``, collated in its threads while the worker trains. Without device
steps, its own collate and transfer, in pinned memory on a GPU. With them, :class:`Collate` plans each step's draws
on the CPU (per row: its window, its flip) and turns the columns into tensors, ragged pixels padded into one pinned
tensor (:class:`transforms.device.Ragged`) and encoded images left as they are; the batch then moves to the device
(``non_blocking``) and the steps run there, so what Ray Data's tasks hand over is what the cache holds (or the encoded
bytes of a streamed split), a fraction of the cropped pixels' bytes for JPEGs.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from ray.data.collate_fn import NumpyBatchCollateFn

from pipeline.config import IngestConfig, TransformSpec
from pipeline.data.steps import device_form, device_params
from transforms.device import Ragged


@dataclass(frozen=True)
class Collated:
    """A batch as :class:`Collate` leaves it (not a tensor batch, so Ray Data hands it over as it is): its columns,
    and each device step's planned draws."""

    batch: dict[str, Any]
    params: list[dict[str, np.ndarray]]


class Collate(NumpyBatchCollateFn):
    """In Ray Data's collate threads: each device step's draws planned for the batch (``epoch``'s), then its columns as
    tensors, pinned for a GPU: ragged pixels padded into one tensor (channels last on the CPU, where torch's resize is
    fastest on them), encoded images left for the device step that decodes them."""

    def __init__(self, steps: list, epoch: int, device: torch.device):
        super().__init__()
        self.steps, self.epoch, self.pinned = steps, epoch, device.type == "cuda"
        self.channels_last = device.type == "cpu"

    def __call__(self, batch: dict[str, np.ndarray]) -> Collated:
        params = [step.plan(batch, self.epoch) for step in self.steps]
        return Collated({name: self.tensor(values) for name, values in batch.items()}, params)

    def tensor(self, values: np.ndarray) -> Any:
        if values.dtype != object:
            with warnings.catch_warnings():  # pixels from Ray's object store are read-only; nothing writes to them
                warnings.filterwarnings("ignore", "The given NumPy array is not writable", UserWarning)
                tensor = torch.from_numpy(values)
            return tensor.pin_memory() if self.pinned else tensor
        if len(values) and all(isinstance(value, np.ndarray) for value in values):
            return self.padded(values)
        return values  # encoded images: the device step that takes them decodes them

    def padded(self, images: np.ndarray) -> Ragged:
        """Images of different sizes (C, H, W) at the top left of one uint8 tensor (N, C, H, W)."""
        sizes = np.array([image.shape[1:] for image in images], dtype=np.int64)
        channels, (height, width) = images[0].shape[0], sizes.max(axis=0)
        shape = (len(images), height, width, channels) if self.channels_last else (len(images), channels, height, width)
        padded = torch.zeros(shape, dtype=torch.uint8, pin_memory=self.pinned)
        target = padded.numpy()
        for i, image in enumerate(images):
            h, w = image.shape[1:]
            if self.channels_last:
                target[i, :h, :w] = image.transpose(1, 2, 0)
            else:
                target[i, :, :h, :w] = image
        return Ragged(padded.permute(0, 3, 1, 2) if self.channels_last else padded, torch.from_numpy(sizes))


class Feed:
    """One split's batches for this worker: Ray Data's shard, then the split's device steps (``steps``, built once
    here from their config)."""

    def __init__(self, steps: dict[str, TransformSpec], device: torch.device, ingest: IngestConfig):
        self.steps = [device_form(spec)(**device_params(spec)) for spec in steps.values()]
        self.device, self.ingest = device, ingest

    def batches(
        self, shard, *, epoch: int, world_size: int, training: bool, seed: int | None = None
    ) -> Iterator[dict[str, Any]]:
        """This worker's shard of the split (``epoch``'s pass) as batches on the device, after the device steps.
        Training shuffles in a local buffer and drops its last partial batch when ``ingest`` says so; validation
        never does."""
        ingest = self.ingest
        options = {
            "batch_size": ingest.batch_size // world_size,
            "prefetch_batches": ingest.prefetch_batches,
            "local_shuffle_buffer_size": ingest.local_shuffle_buffer_size if training else None,
            "local_shuffle_seed": seed,
            "drop_last": ingest.drop_last and training,
        }
        if not self.steps:
            return shard.iter_torch_batches(**options, device=self.device, pin_memory=self.device.type == "cuda")
        return self.on_device(shard.iter_torch_batches(**options, collate_fn=Collate(self.steps, epoch, self.device)))

    def on_device(self, collated: Iterator[Collated]) -> Iterator[dict[str, Any]]:
        for item in collated:
            batch = {name: moved(value, self.device) for name, value in item.batch.items()}
            for step, params in zip(self.steps, item.params):
                batch = step(batch, params)
            yield batch


def moved(value: Any, device: torch.device) -> Any:
    """A column on the training device (``non_blocking``: from pinned memory the copy overlaps the step); encoded
    images stay where they are for the step that decodes them."""
    return value.to(device, non_blocking=True) if isinstance(value, (torch.Tensor, Ragged)) else value
