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
from pathlib import Path

import plain
from report import data_dir, pipeline_run, table, write

from pipeline.config import PipelineConfig

EXPERIMENT = ["+experiment=cifar_vit_cpu"]
TWO_WORKERS = ["scaling.num_workers=2", "scaling.resources_per_worker.CPU=0.5", "scaling.torch_threads=1"]


def ray_floor() -> float:
    """Seconds from command to first batch for Ray Train + Ray Data alone (``bench/floor.py``, a fresh process)."""
    out = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("floor.py"))], check=True, capture_output=True, text=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])["startup_s"]


def plain_loop(cfg: PipelineConfig) -> dict:
    """The same training in one process with a DataLoader (the lean loader: the faster one for CIFAR)."""
    figures = plain.train(cfg, lean=True)
    return {"samples_s": figures["samples_s"], "val_accuracy": figures["val_accuracy"][-1]}


def last_accuracy(figures: dict) -> dict:
    return {**figures, "val_accuracy": figures["val_accuracy"][-1]}


def main() -> None:
    from pipeline.cli import compose

    data_dir()
    with tempfile.TemporaryDirectory() as workdir:
        one = last_accuracy(pipeline_run(EXPERIMENT, Path(workdir) / "one"))
        loop = plain_loop(compose(EXPERIMENT))
        two = last_accuracy(pipeline_run([*EXPERIMENT, *TWO_WORKERS], Path(workdir) / "two"))
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
