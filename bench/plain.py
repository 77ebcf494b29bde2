"""What a user writes without the pipeline: a map-style Dataset over the parquet files, each sample
decoded (torchvision's libjpeg-turbo decoder) and augmented on access, and a DataLoader with a worker per core.

Samples leave the workers as uint8 and are normalized per batch in the consuming process, as the
pipeline does on the training device: a quarter of float32's bytes between processes. Two ways to
augment: torchvision's v2 transforms equivalent to the config's steps (the usual code, any image
size), or ``lean``: hand-written tensor ops for CIFAR's pad + crop + flip (less per-sample overhead).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pyarrow.parquet as pq
import torch
from hydra.utils import instantiate
from torchvision.io import ImageReadMode, decode_jpeg
from torchvision.transforms import v2

from pipeline.config import NormalizeConfig, PipelineConfig

WORKERS = os.cpu_count() or 2  # one per core: the fastest here


class ParquetImages(torch.utils.data.Dataset):
    """Rows held in memory as JPEG bytes; each sample decoded to RGB uint8 (C, H, W) and transformed on access."""

    def __init__(self, directory: str, transform):
        files = sorted(str(p) for p in Path(directory).glob("*.parquet"))
        table = pq.read_table(files, columns=["image", "label"])
        self.images, self.labels = table.column("image").to_pylist(), table.column("label").to_pylist()
        self.transform = transform

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        encoded = torch.frombuffer(bytearray(self.images[i]), dtype=torch.uint8)
        return self.transform(decode_jpeg(encoded, mode=ImageReadMode.RGB)), self.labels[i]


def augmentation(cfg: PipelineConfig, split: str) -> v2.Compose:
    """torchvision's equivalents of the config's steps for ``split`` (those it keeps)."""
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


class LeanCropFlip:
    """CIFAR's training augmentation by hand, per sample: zero-pad and a random window (when the config
    crops: ``crop`` is its ``size`` and ``padding``), and a random mirror (when it flips)."""

    def __init__(self, crop: dict | None, flip: bool):
        self.crop, self.flip = crop, flip

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        if self.crop is not None:
            size, padded = self.crop["size"], torch.nn.functional.pad(image, (self.crop["padding"],) * 4)
            top, left = torch.randint(0, padded.shape[1] - size + 1, (2,)).tolist()
            image = padded[:, top : top + size, left : left + size]
        return image.flip(-1) if self.flip and torch.rand(()) < 0.5 else image


class Normalized:
    """A DataLoader's batches with the images normalized here, in the consuming process."""

    def __init__(self, loader: torch.utils.data.DataLoader, normalize: NormalizeConfig):
        self.loader = loader
        self.mean = torch.tensor(normalize.mean).view(1, -1, 1, 1) * 255
        self.std = torch.tensor(normalize.std).view(1, -1, 1, 1) * 255

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        for images, labels in self.loader:
            yield images.float().sub_(self.mean).div_(self.std), labels  # in place: one float copy


def loader(
    cfg: PipelineConfig, split: str, training: bool, lean: bool = False, shuffle: bool = False
) -> Normalized | torch.utils.data.DataLoader:
    """A DataLoader(num_workers=2, persistent_workers) over one split (``source.train``/``source.valid``)
    with the config's batch size and normalization (none: uint8 batches); ``lean`` for the hand-written
    CIFAR crop + flip; ``shuffle``: a new order each epoch (a permutation of indices: free)."""
    steps = cfg.transforms.active("train")
    if training and lean:
        transform = LeanCropFlip(steps["crop"].fn if "crop" in steps else None, "flip" in steps)
    else:
        transform = augmentation(cfg, "train" if training else "valid")
    dataset = ParquetImages(getattr(cfg.source, split), transform)
    batches = torch.utils.data.DataLoader(
        dataset, batch_size=cfg.ingest.batch_size, shuffle=shuffle, num_workers=WORKERS, persistent_workers=True
    )
    return Normalized(batches, cfg.ingest.normalize) if cfg.ingest.normalize else batches


def train(cfg: PipelineConfig, lean: bool, shuffle: bool = False, device: str = "cpu") -> dict:
    """The config's training in this process, fed by :func:`loader`: the model, optimizer, schedule, seed,
    batch size, epochs and mixed precision (``train.amp``, on CUDA) of ``cfg``, on ``device``. Per epoch:
    samples/s of the training loop, the share of it spent waiting for the next batch (as the pipeline's
    ``data_wait_fraction``), and validation accuracy."""
    torch.manual_seed(cfg.train.seed)
    if cfg.scaling.torch_threads:
        torch.set_num_threads(cfg.scaling.torch_threads)
    model = instantiate(cfg.model, _convert_="all").to(device)
    amp = cfg.train.amp and device.startswith("cuda")  # bfloat16 needs no GradScaler
    autocast = torch.autocast("cuda", dtype=getattr(torch, cfg.train.amp_dtype), enabled=amp)
    optimizer = instantiate(cfg.optim, params=model.parameters(), _convert_="all")
    train_batches = loader(cfg, "train", True, lean=lean, shuffle=shuffle)
    valid_batches = loader(cfg, "valid", False)
    epochs, scheduler = cfg.train.epochs, None
    if cfg.scheduler is not None:
        total = epochs * len(train_batches)
        scheduler = instantiate(cfg.scheduler, optimizer=optimizer, total_steps=total, _convert_="all")
    figures = {"samples_s": [], "data_wait_fraction": [], "val_accuracy": []}
    for _ in range(epochs):
        model.train()
        start, waited, seen, batches = time.perf_counter(), 0.0, 0, iter(train_batches)
        while True:
            before = time.perf_counter()
            batch = next(batches, None)
            waited += time.perf_counter() - before
            if batch is None:
                break
            images, labels = batch[0].to(device, non_blocking=True), batch[1].to(device, non_blocking=True)
            with autocast:
                loss = torch.nn.functional.cross_entropy(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
            seen += len(labels)
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
                    outputs = model(images.to(device))
                correct += (outputs.argmax(dim=1).cpu() == labels).sum().item()
                count += len(labels)
        figures["val_accuracy"].append(round(correct / count, 4))
    return figures
