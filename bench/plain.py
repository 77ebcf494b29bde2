"""What a user writes without the pipeline: a map-style Dataset over the parquet files, decoded and
augmented per sample (the pipeline's JPEG decoder, torchvision's v2 transforms), and a DataLoader."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import simplejpeg
import torch
from torchvision.transforms import v2


class ParquetImages(torch.utils.data.Dataset):
    """Rows held in memory as JPEG bytes; each sample decoded, augmented and normalized on access."""

    def __init__(self, directory: str, augment: list, normalize: dict):
        files = sorted(str(p) for p in Path(directory).glob("*.parquet"))
        table = pq.read_table(files, columns=["image", "label"])
        self.images, self.labels = table.column("image").to_pylist(), table.column("label").to_pylist()
        self.transform = v2.Compose(
            [*augment, v2.ToDtype(torch.float32, scale=True), v2.Normalize(normalize["mean"], normalize["std"])]
        )

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        image = torch.from_numpy(simplejpeg.decode_jpeg(self.images[i], colorspace="RGB")).permute(2, 0, 1)
        return self.transform(image), self.labels[i]


def augmentation(cfg: dict) -> list:
    """torchvision's equivalents of the config's training crop and flip steps (those it keeps)."""
    steps = cfg["transforms"]["train"]
    crop = (
        [v2.RandomCrop(steps["crop"]["fn"]["size"], padding=steps["crop"]["fn"]["padding"])]
        if steps.get("crop")
        else []
    )
    return crop + ([v2.RandomHorizontalFlip()] if steps.get("flip") else [])


def loader(cfg: dict, split: str, training: bool) -> torch.utils.data.DataLoader:
    """A DataLoader(num_workers=2) over one split with the config's batch size and normalization."""
    dataset = ParquetImages(cfg["source"][split], augmentation(cfg) if training else [], cfg["ingest"]["normalize"])
    return torch.utils.data.DataLoader(
        dataset, batch_size=cfg["ingest"]["batch_size"], num_workers=2, persistent_workers=True
    )
