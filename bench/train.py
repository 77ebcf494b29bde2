"""Training: the pipeline against a plain single-process PyTorch loop, then the pipeline's scaling.

- pipeline, 1 worker: ``python -m pipeline +experiment=cifar_vit_cpu`` as a user runs it (2 epochs),
  its figures read back from its MLflow run: samples/s per epoch, val_accuracy, data_wait_fraction
  and startup_s (from the command to the first training step);
- plain loop: the tutorial's step 1 in this process: the same model, optimizer, schedule, batch
  size, seed and data (``bench/plain.py``'s lean DataLoader with 2 workers, the faster one for
  CIFAR in ``bench/ingest.py``), no Ray;
- pipeline, 2 workers: the same command with 2 DDP workers at half a CPU each;
- Ray's floor: ``bench/floor.py``, the least a Ray Train job fed by Ray Data takes here from command to
  first batch, so the pipeline's start-up reads as a ratio to what Ray alone needs.

    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 PIPELINE_DATA_DIR=../shared/data python bench/train.py

Takes about 15 minutes on 2 cores. Prints a table and writes outputs/bench/train.json.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import plain
import torch
from hydra.utils import instantiate
from mlflow import MlflowClient
from report import data_dir, table, write

EXPERIMENT = ["+experiment=cifar_vit_cpu"]
TWO_WORKERS = ["scaling.num_workers=2", "scaling.resources_per_worker.CPU=0.5", "scaling.torch_threads=1"]


def pipeline_run(overrides: list[str], workdir: str) -> dict:
    """Run the pipeline's command; its figures come from the MLflow run it logged."""
    outputs = Path(workdir) / "outputs"
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "pipeline", *EXPERIMENT, *overrides, f"paths.outputs={outputs}"],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wall = time.perf_counter() - start
    client = MlflowClient(f"sqlite:///{outputs / 'mlflow.db'}")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])

    def history(key: str) -> list[float]:
        return [m.value for m in sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)]

    return {
        "samples_s": [round(v) for v in history("train_throughput")],
        "val_accuracy": round(history("val_accuracy")[-1], 4),
        "data_wait_fraction": [round(v, 3) for v in history("data_wait_fraction")],
        "startup_s": round(history("startup_s")[0], 1),
        "wall_s": round(wall, 1),
    }


def ray_floor() -> float:
    """Seconds from command to first batch for Ray Train + Ray Data alone (``bench/floor.py``, a fresh process)."""
    out = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("floor.py"))], check=True, capture_output=True, text=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])["startup_s"]


def plain_loop(cfg: dict) -> dict:
    """The same training in one process with a DataLoader: what the pipeline must not be slower than."""
    torch.manual_seed(cfg["train"]["seed"])
    if cfg["scaling"]["torch_threads"]:
        torch.set_num_threads(cfg["scaling"]["torch_threads"])
    model = instantiate(cfg["model"], _convert_="all")
    optimizer = instantiate(cfg["optim"], params=model.parameters(), _convert_="all")
    # the lean loader: the faster DataLoader for CIFAR (bench/ingest.py)
    train_batches, valid_batches = plain.loader(cfg, "train", True, lean=True), plain.loader(cfg, "valid", False)
    epochs = cfg["train"]["epochs"]
    scheduler = instantiate(
        cfg["scheduler"], optimizer=optimizer, total_steps=epochs * len(train_batches), _convert_="all"
    )
    samples_s, accuracy = [], 0.0
    for _ in range(epochs):
        model.train()
        start, seen = time.perf_counter(), 0
        for images, labels in train_batches:
            loss = torch.nn.functional.cross_entropy(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            seen += len(labels)
        samples_s.append(round(seen / (time.perf_counter() - start)))
        model.eval()
        correct = count = 0
        with torch.no_grad():
            for images, labels in valid_batches:
                correct += (model(images).argmax(dim=1) == labels).sum().item()
                count += len(labels)
        accuracy = correct / count
    return {"samples_s": samples_s, "val_accuracy": round(accuracy, 4)}


def main() -> None:
    from pipeline.config import compose

    data_dir()
    with tempfile.TemporaryDirectory() as workdir:
        one = pipeline_run([], f"{workdir}/one")
        loop = plain_loop(compose(EXPERIMENT))
        two = pipeline_run(TWO_WORKERS, f"{workdir}/two")
    floor = ray_floor()
    figures = {
        "pipeline_1_worker": one,
        "plain_loop": loop,
        "pipeline_2_workers": two,
        "ray_floor_startup_s": floor,
        "startup_over_floor": round(one["startup_s"] / floor, 2),
        "samples_s_ratio": [round(p / q, 3) for p, q in zip(one["samples_s"], loop["samples_s"])],
        "val_accuracy_gap": round(one["val_accuracy"] - loop["val_accuracy"], 4),
        "two_over_one_workers": [round(p / q, 3) for p, q in zip(two["samples_s"], one["samples_s"])],
    }
    rows = [
        ("pipeline, 1 worker", *one["samples_s"], one["val_accuracy"], one["startup_s"], one["data_wait_fraction"]),
        ("plain PyTorch loop", *loop["samples_s"], loop["val_accuracy"], "", ""),
        (
            "pipeline / plain",
            *(f"{r}x" for r in figures["samples_s_ratio"]),
            f"{figures['val_accuracy_gap']:+}",
            "",
            "",
        ),
        ("pipeline, 2 workers", *two["samples_s"], two["val_accuracy"], two["startup_s"], two["data_wait_fraction"]),
        ("2 workers / 1 worker", *(f"{r}x" for r in figures["two_over_one_workers"]), "", "", ""),
        ("Ray Train + Ray Data alone (floor)", "", "", "", floor, ""),
        ("pipeline / floor", "", "", "", f"{figures['startup_over_floor']}x", ""),
    ]
    print(
        table(
            rows,
            (
                "cifar_vit_cpu, 2 epochs",
                "epoch 1 samples/s",
                "epoch 2 samples/s",
                "val_accuracy",
                "startup_s",
                "data_wait",
            ),
        )
    )
    write("train", figures)


if __name__ == "__main__":
    main()
