"""Ingest throughput: the pipeline's own ingest path against a plain PyTorch DataLoader, side by side,
on two image sets: CIFAR-10 (50,000 32x32 JPEGs: decode, pad + crop, flip) and photos at real sizes
(``source=photos``: 6,400 JPEGs with a shorter side of 256-512 pixels, written offline when missing;
ImageNet's random-resized-crop to 224 + flip). Two epochs each:
- pipeline: its source, its configured transforms (Ray Data) and its ``iter_torch_batches`` settings,
  consumed by one Ray Train worker that runs no model and takes no core of its own, so Ray Data has
  ``scaling.data_cpus`` CPUs (photos: 2, then 1: how ingest scales with the CPUs it is given);
- DataLoader: what a user writes without the pipeline (``bench/plain.py``): a map-style ``Dataset``
  over the same files doing the same steps per sample with torchvision (its JPEG decoder, its v2
  transforms; for CIFAR also a lean hand-written crop + flip), ``DataLoader(num_workers=2)``, the same
  batch size; the faster variant is the baseline;
- one process, no framework, per core: every row decoded at full size (the decode ceiling) and
  (photos) each side's per-image work alone: the pipeline's crop step, and torchvision's decode +
  ``RandomResizedCrop`` + flip per sample. Their ratio bounds the pipeline's lead on equal cores.

Both consumers stand in for a GPU: they take uint8 batches and do not normalize them on the CPU (the
pipeline does that on the GPU: ``ingest.normalize``), so the figures are the CPU's work of feeding one.

    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 PIPELINE_DATA_DIR=../shared/data \
        python bench/ingest.py [--sets cifar,photos] [OVERRIDES...]

Extra arguments are config overrides for the pipeline side (for example ``ingest.prefetch_batches=4``, or
``ingest.shuffle=true`` for the cost of the seeded shuffle; both sets are stored shuffled, so it is off).
Prints a table per set and writes outputs/bench/ingest.json.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import plain
import pyarrow.parquet as pq
import simplejpeg
from report import data_dir, table, write

EPOCHS = 2
# One consuming worker that runs no model, on a logical CPU of its own beside the machine's cores, so
# Ray Data gets every core (scaling.data_cpus); it shares them, as the DataLoader's main process does.
PIPELINE = [
    f"ray.num_cpus={os.cpu_count() + 1}",
    "scaling.num_workers=1",
    "scaling.resources_per_worker.CPU=1",
    "ingest.batch_size=128",
    "ingest.shuffle=false",
    "ingest.normalize=null",  # on a GPU, the GPU's work; here it would take the data CPUs' time
]
SETS = {
    "cifar": {"overrides": [], "data_cpus": [2], "lean": True},
    "photos": {"overrides": ["+experiment=photos_resnet", "scaling=cpu"], "data_cpus": [2, 1], "lean": False},
}


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
    import ray
    import ray.train
    from ray.train.torch import TorchTrainer

    from pipeline import preprocess, source, trainer
    from pipeline.cluster import connect
    from pipeline.config import compose

    cfg = compose([*overrides, *PIPELINE])
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


def dataloader_epochs(cfg: dict, lean: bool) -> list[dict]:
    """Per-epoch rows and seconds; epoch 1 includes reading the files, as the pipeline's epoch 1 does."""
    start, epochs = time.perf_counter(), []
    batches = plain.loader(cfg, "train", training=True, lean=lean)
    for _ in range(EPOCHS):
        rows = 0
        for images, _labels in batches:
            rows += len(images)
        epochs.append({"rows": rows, "seconds": time.perf_counter() - start})
        start = time.perf_counter()
    return epochs


def one_process(files: list[str], cfg: dict) -> dict:
    """Images/s in this one process, no framework: every row decoded at full size, and (photos) the
    pipeline's own crop step and torchvision's per-sample decode + augmentation over the same rows."""
    import torch
    from hydra.utils import instantiate
    from torchvision.io import ImageReadMode, decode_jpeg

    images = pq.read_table(files, columns=["image"]).column("image").to_pylist()

    def rate(work) -> int:
        start = time.perf_counter()
        work()
        return round(len(images) / (time.perf_counter() - start))

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core's rates
    rates = {"decode": rate(lambda: [simplejpeg.decode_jpeg(data, colorspace="RGB") for data in images])}
    crop = cfg["transforms"]["train"].get("crop") or {}
    if crop.get("fn", {}).get("_target_") == "transforms.random_resized_crop":
        step, column = instantiate(crop["fn"], _partial_=True, _convert_="all"), np.array(images, dtype=object)
        augment = plain.augmentation(cfg, "train")
        encoded = [torch.frombuffer(bytearray(data), dtype=torch.uint8) for data in images]
        rates["crop_step"] = rate(lambda: [step({"image": column[i : i + 400]}) for i in range(0, len(column), 400)])
        rates["torchvision_per_sample"] = rate(
            lambda: [augment(decode_jpeg(e, mode=ImageReadMode.RGB)) for e in encoded]
        )
    torch.set_num_threads(threads)
    return rates


def measure(name: str, overrides: list[str]) -> dict:
    """One image set: the pipeline at each ``data_cpus``, the DataLoader variants, one process alone."""
    spec, rate = SETS[name], lambda e: round(e["rows"] / e["seconds"])
    runs = {}
    for cpus in spec["data_cpus"]:
        epochs, cfg = pipeline_epochs([*spec["overrides"], f"scaling.data_cpus={cpus}", *overrides])
        runs[cpus] = {
            "img_s": [rate(e) for e in epochs],
            "first_batch_s": [round(e["first_batch_s"], 2) for e in epochs],
        }
    loaders = {"torchvision v2": [rate(e) for e in dataloader_epochs(cfg, lean=False)]}
    if spec["lean"]:
        loaders["lean hand-written"] = [rate(e) for e in dataloader_epochs(cfg, lean=True)]
    baseline = max(loaders, key=lambda k: loaders[k][1])  # the faster warm epoch
    files = sorted(str(p) for p in Path(cfg["source"]["train"]).glob("*.parquet"))
    pipeline = runs[spec["data_cpus"][0]]["img_s"]
    figures = {
        "overrides": [*spec["overrides"], *PIPELINE, *overrides],
        "rows": epochs[0]["rows"],
        "pipeline_img_s": pipeline,
        "pipeline_first_batch_s": runs[spec["data_cpus"][0]]["first_batch_s"],
        "pipeline_by_data_cpus": runs,
        "dataloader_img_s": loaders,
        "baseline": baseline,
        "cold_ratio": round(pipeline[0] / loaders[baseline][0], 2),
        "warm_ratio": round(pipeline[1] / loaders[baseline][1], 2),
        "one_process_img_s": one_process(files, cfg),
        "cpus": os.cpu_count(),
    }
    rows = [(f"pipeline, {cpus} data CPUs", *run["img_s"]) for cpus, run in runs.items()]
    rows += [(f"DataLoader(num_workers=2), {loader}", *rates) for loader, rates in loaders.items()]
    rows += [
        (f"pipeline / DataLoader ({baseline})", f"{figures['cold_ratio']}x", f"{figures['warm_ratio']}x"),
        ("pipeline: seconds to its first batch", *figures["pipeline_first_batch_s"]),
    ]
    if len(runs) > 1:
        low, high = min(runs), max(runs)
        figures["data_cpus_scaling"] = round(runs[high]["img_s"][1] / runs[low]["img_s"][1], 2)
        rows.append((f"warm, {high} data CPUs / {low}", "", f"{figures['data_cpus_scaling']}x"))
    rows += [(f"one process, {what}", rate, "") for what, rate in figures["one_process_img_s"].items()]
    if "crop_step" in figures["one_process_img_s"]:  # the most the pipeline can lead by on equal cores
        one = figures["one_process_img_s"]
        figures["per_image_bound"] = round(one["crop_step"] / one["torchvision_per_sample"], 2)
        rows.append(("one process, crop step / torchvision", "", f"{figures['per_image_bound']}x"))
    print(f"\n{name}: {figures['rows']} rows\n" + table(rows, ("images/s", "epoch 1 (cold)", "epoch 2 (warm)")))
    return figures


def main(sets: list[str], overrides: list[str]) -> dict:
    data_dir()
    figures = {name: measure(name, overrides) for name in sets}
    write("ingest", figures)
    return figures


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Ingest throughput: the pipeline against a DataLoader.")
    parser.add_argument("--sets", default=",".join(SETS), help=f"comma-separated, of {', '.join(SETS)}")
    arguments, rest = parser.parse_known_args()
    main(arguments.sets.split(","), rest)
