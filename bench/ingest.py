"""Ingest throughput: the pipeline's own ingest path against a plain PyTorch DataLoader, side by side.

Both sides read the real CIFAR-10 training parquet (50,000 JPEG rows) and decode, randomly crop and
flip, and normalize every image, two epochs each:
- pipeline: its source, its configured transforms (Ray Data) and its ``iter_torch_batches`` settings,
  consumed by one Ray Train worker that runs no model;
- DataLoader: what a user writes without the pipeline (``bench/plain.py``): a map-style ``Dataset``
  over the same files doing the same steps per sample (the same JPEG decoder, simplejpeg, then
  torchvision's v2 transforms), ``DataLoader(num_workers=2, persistent_workers=True)``, the same
  batch size;
- decode only: simplejpeg over every row in this one process, no framework: the ceiling one core sets.

    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 PIPELINE_DATA_DIR=../shared/data python bench/ingest.py [OVERRIDES...]

Extra arguments are config overrides for the pipeline side (for example ``ingest.prefetch_batches=4``, or
``ingest.shuffle=true`` for the cost of the seeded shuffle; CIFAR-10 is stored shuffled, so it is off here).
Prints a table and writes outputs/bench/ingest.json.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import plain
import pyarrow.parquet as pq
import simplejpeg
from report import data_dir, table, write

EPOCHS = 2
# One worker without a model needs little CPU: the rest of the machine decodes.
PIPELINE = [
    "scaling.num_workers=1",
    "scaling.resources_per_worker.CPU=0.25",
    "ingest.batch_size=128",
    "ingest.shuffle=false",
]


def consume(config: dict) -> None:
    """A Ray Train worker that takes every batch of its shard, as training would, but runs no model."""
    import ray.train.torch

    from pipeline.worker import train_batches

    cfg, rates = config["cfg"], []
    label = cfg["source"]["label_column"]
    device = ray.train.torch.get_device()
    for epoch in range(EPOCHS):
        start, rows, first = time.perf_counter(), 0, None
        for batch in train_batches(cfg, epoch, config["epoch_counter"], None, device, 1):
            rows += len(batch[label])
            first = first or time.perf_counter() - start
        rates.append({"rows": rows, "seconds": time.perf_counter() - start, "first_batch_s": first})
    Path(config["out"]).write_text(json.dumps(rates))


def pipeline_epochs(overrides: list[str]) -> tuple[list[dict], dict]:
    """Per-epoch rows and seconds through the pipeline's ingest path, with the resolved config used."""
    import ray.train
    from ray.train.torch import TorchTrainer

    from pipeline import preprocess, source, trainer
    from pipeline.cluster import connect
    from pipeline.config import compose

    cfg = compose([*PIPELINE, *overrides])
    split = source.prepare(cfg["source"])["train"]
    connect(cfg["ray"])
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "epochs.json"
        scaling_config, _ = trainer.trainer_settings(cfg["scaling"])
        data = preprocess.training_data(cfg, {"train": split})
        TorchTrainer(
            consume,
            train_loop_config={"cfg": cfg, "out": str(out), "epoch_counter": data.epoch_counter},
            scaling_config=scaling_config,
            datasets=data.datasets,
            dataset_config=trainer.data_config(cfg),
            run_config=ray.train.RunConfig(storage_path=tmp, name="ingest"),
        ).fit()
        epochs = json.loads(out.read_text())
    ray.shutdown()
    return epochs, cfg


def dataloader_epochs(cfg: dict) -> list[dict]:
    """Per-epoch rows and seconds; epoch 1 includes reading the files, as the pipeline's epoch 1 does."""
    start, epochs = time.perf_counter(), []
    batches = plain.loader(cfg, "train", training=True)
    for _ in range(EPOCHS):
        rows = 0
        for images, _labels in batches:
            rows += len(images)
        epochs.append({"rows": rows, "seconds": time.perf_counter() - start})
        start = time.perf_counter()
    return epochs


def decode_only(files: list[str]) -> dict:
    """One process decoding every image: no framework, no other step."""
    images = pq.read_table(files, columns=["image"]).column("image").to_pylist()
    start = time.perf_counter()
    for data in images:
        simplejpeg.decode_jpeg(data, colorspace="RGB")
    return {"rows": len(images), "seconds": time.perf_counter() - start}


def main(overrides: list[str]) -> dict:
    data_dir()
    pipeline, cfg = pipeline_epochs(overrides)
    files = sorted(str(p) for p in Path(cfg["source"]["train"]).glob("*.parquet"))
    loader = dataloader_epochs(cfg)
    decode = decode_only(files)
    rate = lambda e: round(e["rows"] / e["seconds"])  # noqa: E731
    figures = {
        "overrides": [*PIPELINE, *overrides],
        "pipeline_img_s": [rate(e) for e in pipeline],
        "dataloader_img_s": [rate(e) for e in loader],
        "decode_only_img_s": rate(decode),
        "rows": [e["rows"] for e in pipeline],
        "pipeline_first_batch_s": [round(e["first_batch_s"], 2) for e in pipeline],
    }
    figures["cold_ratio"] = round(figures["pipeline_img_s"][0] / figures["dataloader_img_s"][0], 2)
    figures["warm_ratio"] = round(figures["pipeline_img_s"][1] / figures["dataloader_img_s"][1], 2)
    print(
        table(
            [
                ("pipeline (Ray Data + Ray Train worker)", *figures["pipeline_img_s"]),
                ("DataLoader(num_workers=2)", *figures["dataloader_img_s"]),
                ("pipeline / DataLoader", f"{figures['cold_ratio']}x", f"{figures['warm_ratio']}x"),
                ("pipeline: seconds to its first batch", *figures["pipeline_first_batch_s"]),
                ("decode only, one process", figures["decode_only_img_s"], ""),
            ],
            ("images/s", "epoch 1 (cold)", "epoch 2 (warm)"),
        )
    )
    write("ingest", figures)
    return figures


if __name__ == "__main__":
    main(sys.argv[1:])
