"""The plain PyTorch loop a competent user writes, run as a command of its own so that its whole run is
timed as the pipeline's is: a map-style Dataset over the parquet rows, a DataLoader with a worker per core
and persistent workers (pinned memory on a GPU), uint8 batches moved ``non_blocking`` and normalized on the
device.

Two choices name the baseline, and every benchmark row says which it ran against:

- ``--data encoded``: the JPEG bytes in memory, decoded on every access (an ImageFolder loop), or ``decoded``:
  each split decoded once before the first epoch and held in memory (torchvision's CIFAR10 holds its arrays
  so): the loop to beat when the pipeline caches its decoded rows.
- ``--transforms torchvision``: its decoder and the v2 transforms equivalent to the config's steps (the usual
  code), or ``pipeline``: the config's own steps from ``transforms/`` on whole batches in the DataLoader's
  workers (the same work as the pipeline's, so the difference is what its engine costs).

    python bench/plain.py --data decoded --transforms pipeline [--device cuda] OVERRIDES...

Prints one JSON line: per epoch samples/s, data wait, val_accuracy and the wall clock at its end (``epoch_ends``), the
wall clock at the first training step's end and the last validation's (``first_step_at``, ``validated_at``), for the
caller's whole-command times, the training rows and this process's id (its DataLoader workers are the rest).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch
from hydra.utils import instantiate
from torchvision.io import ImageReadMode, decode_jpeg
from torchvision.transforms import v2

from pipeline.config import PipelineConfig
from pipeline.data.steps import Steps, cached_steps, streamed_steps

WORKERS = os.cpu_count() or 2  # one per core: the fastest here


def torchvision_transform(cfg: PipelineConfig, split: str) -> v2.Compose:
    """torchvision's per-sample equivalents of the config's steps for ``split`` (past the decode)."""
    out = []
    for step in cfg.transforms.active(split).values():
        fn, target = step.fn, step.fn["_target_"]
        if target == "transforms.random_crop":
            out.append(v2.RandomCrop(fn["size"], padding=fn["padding"]))
        elif target == "transforms.random_resized_crop":
            out.append(v2.RandomResizedCrop(fn["size"], scale=tuple(fn["scale"]), antialias=True))
            if fn.get("flip"):
                out.append(v2.RandomHorizontalFlip(fn["flip"]))
        elif target == "transforms.random_flip":
            out.append(v2.RandomHorizontalFlip())
        elif target == "transforms.decode_image" and fn.get("size"):
            out += [v2.Resize(fn.get("resize") or fn["size"], antialias=True), v2.CenterCrop(fn["size"])]
    return v2.Compose(out) if out else v2.Identity()


def decoded_jpeg(data: bytes) -> torch.Tensor:
    """torchvision's libjpeg-turbo decode, RGB uint8 (C, H, W)."""
    return decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)


class Rows(torch.utils.data.Dataset):
    """A split's rows in memory (encoded bytes or decoded pixels) and what each batch of them goes through:
    ``batch_fn`` on a whole batch (the pipeline's steps, given the epoch) or ``sample_fn`` per row (torchvision's).
    Indices arrive as ``(epoch, row)`` pairs from :class:`EpochBatches`, so persistent workers know the epoch."""

    def __init__(self, images: list | torch.Tensor, labels: list[int], batch_fn=None, sample_fn=None):
        self.images, self.labels, self.batch_fn, self.sample_fn = images, labels, batch_fn, sample_fn

    def __len__(self) -> int:
        return len(self.labels)

    def __getitems__(self, keys: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        epoch, rows = keys[0][0], [row for _, row in keys]
        labels = torch.tensor([self.labels[row] for row in rows])
        if self.sample_fn is not None:
            return torch.stack([self.sample_fn(self.images[row]) for row in rows]), labels
        if isinstance(self.images, torch.Tensor):
            column = self.images[rows].numpy()
        else:
            column = object_column([self.images[row] for row in rows])
        return torch.from_numpy(np.ascontiguousarray(self.batch_fn({"image": column}, epoch=epoch)["image"])), labels


class EpochBatches(torch.utils.data.Sampler):
    """Batches of ``(epoch, row)``: a new seeded order every epoch when ``shuffle``, the last batch partial."""

    def __init__(self, rows: int, batch_size: int, shuffle: bool, seed: int):
        self.rows, self.batch_size, self.shuffle, self.seed, self.epoch = rows, batch_size, shuffle, seed, 0

    def __len__(self) -> int:
        return -(-self.rows // self.batch_size)

    def __iter__(self):
        epoch, self.epoch = self.epoch, self.epoch + 1
        order = torch.randperm(self.rows, generator=torch.Generator().manual_seed(self.seed * 1000 + epoch))
        order = order.tolist() if self.shuffle else range(self.rows)
        for start in range(0, self.rows, self.batch_size):
            yield [(epoch, row) for row in order[start : start + self.batch_size]]


def as_is(batch):
    """The DataLoader's collate: :meth:`Rows.__getitems__` already returns a batch."""
    return batch


def image_column(fn, column: np.ndarray) -> np.ndarray:
    """``fn`` (a batch function) on a batch of just an image column."""
    return fn({"image": column})["image"]


def object_column(values: list) -> np.ndarray:
    column = np.empty(len(values), dtype=object)
    column[:] = values
    return column


def decode_all(images: list, fn) -> list | torch.Tensor:
    """Every image through the batch function ``fn`` once, in a worker per core: one uint8 tensor when the
    images share a size (as torchvision's CIFAR10 holds them), else a list of arrays."""
    chunks = [object_column(images[i : i + 256]) for i in range(0, len(images), 256)]
    loader = torch.utils.data.DataLoader(
        chunks, batch_size=None, num_workers=WORKERS, collate_fn=functools.partial(image_column, fn)
    )
    parts = list(loader)
    if all(part.dtype != object for part in parts) and len({part.shape[1:] for part in parts}) == 1:
        return torch.from_numpy(np.concatenate(parts))
    return [image for part in parts for image in part]


def torchvision_decode(batch: dict) -> dict:
    return {"image": np.stack([decoded_jpeg(data).numpy() for data in batch["image"]])}


def rows(cfg: PipelineConfig, split: str, data: str, transforms: str) -> Rows:
    """One split (``train`` or ``valid``) as the baseline ``data`` x ``transforms`` holds and transforms it."""
    table = pq.read_table(sorted(Path(getattr(cfg.source, split)).glob("*.parquet")), columns=["image", "label"])
    images, labels = table.column("image").to_pylist(), table.column("label").to_pylist()
    steps = cfg.transforms.active(split)
    if transforms == "torchvision":
        augment = torchvision_transform(cfg, split)
        if data == "decoded":
            return Rows(decode_all(images, torchvision_decode), labels, sample_fn=augment)
        return Rows(images, labels, sample_fn=v2.Compose([decoded_jpeg, augment]))
    if data == "decoded":
        once, every_epoch = cached_steps(steps)
        return Rows(decode_all(images, Steps(once, first=[])), labels, batch_fn=Steps(every_epoch, first=[]))
    return Rows(images, labels, batch_fn=Steps(streamed_steps(steps), first=[]))


def loader(cfg: PipelineConfig, dataset: Rows, shuffle: bool, device: str) -> torch.utils.data.DataLoader:
    """A worker per core, persistent, pinned memory on a GPU, the config's batch size and seed."""
    return torch.utils.data.DataLoader(
        dataset,
        batch_sampler=EpochBatches(len(dataset), cfg.ingest.batch_size, shuffle, cfg.train.seed),
        collate_fn=as_is,
        num_workers=WORKERS,
        persistent_workers=True,
        pin_memory=device.startswith("cuda"),
    )


def train(cfg: PipelineConfig, data: str, transforms: str, device: str = "cpu") -> dict:
    """The config's training in this process: its model, optimizer, schedule, seed, batch size, epochs, shuffle
    and mixed precision (``train.amp``, on CUDA), on ``device``. Per epoch: samples/s of the training loop, the
    share of it spent waiting for the next batch (as the pipeline's ``data_wait_fraction``), validation accuracy."""
    torch.manual_seed(cfg.train.seed)
    if cfg.scaling.torch_threads:
        torch.set_num_threads(cfg.scaling.torch_threads)
    model = instantiate(cfg.model, _convert_="all").to(device)
    amp = cfg.train.amp and device.startswith("cuda")  # bfloat16 needs no GradScaler
    autocast = torch.autocast("cuda", dtype=getattr(torch, cfg.train.amp_dtype), enabled=amp)
    optimizer = instantiate(cfg.optim, params=model.parameters(), _convert_="all")
    train_batches = loader(cfg, rows(cfg, "train", data, transforms), cfg.ingest.shuffle, device)
    valid_batches = loader(cfg, rows(cfg, "valid", data, transforms), False, device)
    normalize = cfg.ingest.normalize
    if normalize:
        mean = torch.tensor(normalize.mean, device=device).view(1, -1, 1, 1) * 255
        std = torch.tensor(normalize.std, device=device).view(1, -1, 1, 1) * 255

    def on_device(images: torch.Tensor) -> torch.Tensor:
        images = images.to(device, non_blocking=True)
        return images.float().sub_(mean).div_(std) if normalize else images

    epochs, scheduler = cfg.train.epochs, None
    if cfg.scheduler is not None:
        total = epochs * len(train_batches)
        scheduler = instantiate(cfg.scheduler, optimizer=optimizer, total_steps=total, _convert_="all")
    figures = {"samples_s": [], "data_wait_fraction": [], "val_accuracy": [], "epoch_ends": []}
    first_step_at = None
    for _ in range(epochs):
        model.train()
        start, waited, seen, batches = time.perf_counter(), 0.0, 0, iter(train_batches)
        while True:
            before = time.perf_counter()
            batch = next(batches, None)
            waited += time.perf_counter() - before
            if batch is None:
                break
            images, labels = on_device(batch[0]), batch[1].to(device, non_blocking=True)
            with autocast:
                loss = torch.nn.functional.cross_entropy(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
            seen += len(labels)
            first_step_at = first_step_at or time.time()
        if device.startswith("cuda"):
            torch.cuda.synchronize()  # the last steps' kernels belong to this epoch
        elapsed = time.perf_counter() - start
        figures["samples_s"].append(round(seen / elapsed))
        figures["data_wait_fraction"].append(round(waited / elapsed, 3))
        model.eval()
        correct = count = 0
        with torch.no_grad():
            for images, labels in valid_batches:
                with autocast:
                    outputs = model(on_device(images))
                correct += (outputs.argmax(dim=1).cpu() == labels).sum().item()
                count += len(labels)
        figures["val_accuracy"].append(round(correct / count, 4))
        figures["epoch_ends"].append(time.time())
    return {
        **figures,
        "first_step_at": first_step_at,
        "validated_at": time.time(),
        "train_rows": len(train_batches.dataset),
        "pid": os.getpid(),
    }


if __name__ == "__main__":
    from pipeline.api import compose

    parser = argparse.ArgumentParser(description="The plain PyTorch loop, one baseline.")
    parser.add_argument("--data", choices=("encoded", "decoded"), required=True)
    parser.add_argument("--transforms", choices=("torchvision", "pipeline"), required=True)
    parser.add_argument("--device", default="cpu")
    arguments, overrides = parser.parse_known_args()
    figures = train(compose(overrides), arguments.data, arguments.transforms, arguments.device)
    print(json.dumps(figures), flush=True)
