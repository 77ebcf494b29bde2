"""Training: the pipeline against a plain single-process PyTorch loop, then one worker of two threads.

- pipeline: ``python -m pipeline +experiment=cifar_vit_cpu`` as a user runs it (2 epochs, two DDP workers
  of one thread each),
  its figures read back from its MLflow run: samples/s per epoch, val_accuracy, data_wait_fraction
  and startup_s (from the command to the first training step);
- plain loop: the tutorial's step 1 in this process: the same model, optimizer, schedule, batch
  size, seed and data (``bench/plain.py``'s lean DataLoader with 2 workers, the faster one for
  CIFAR in ``bench/ingest.py``), no Ray;
- pipeline, 1 worker: the same command with one worker of both threads (the experiment's former
  setting: a two-thread step stalls whenever Ray's own processes take a core);
- Ray's floor: ``bench/floor.py``, the least a Ray Train job of the same shape (two workers of a CPU, a
  training and a validation dataset) fed by Ray Data takes here from command to first batch, so the
  pipeline's start-up reads as a ratio to what Ray alone needs.

    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 PIPELINE_DATA_DIR=../shared/data python bench/train.py

Takes about 15 minutes on 2 cores. Prints a table and writes outputs/bench/train.json.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import plain
from report import data_dir, pipeline_run, ray_floor, table, write

from pipeline.config import PipelineConfig

EXPERIMENT = ["+experiment=cifar_vit_cpu"]
ONE_WORKER = ["scaling.num_workers=1", "scaling.resources_per_worker.CPU=1", "scaling.torch_threads=2"]


def plain_loop(cfg: PipelineConfig) -> dict:
    """The same training in one process with a DataLoader (the lean loader: the faster one for CIFAR)."""
    figures = plain.train(cfg, lean=True)
    return {"samples_s": figures["samples_s"], "val_accuracy": figures["val_accuracy"][-1]}


def last_accuracy(figures: dict) -> dict:
    return {**figures, "val_accuracy": figures["val_accuracy"][-1]}


def main() -> None:
    from pipeline.api import compose

    data_dir()
    with tempfile.TemporaryDirectory() as workdir:
        run = last_accuracy(pipeline_run(EXPERIMENT, Path(workdir) / "two"))
        loop = plain_loop(compose([*EXPERIMENT, *ONE_WORKER]))  # one process: both cores' threads
        one = last_accuracy(pipeline_run([*EXPERIMENT, *ONE_WORKER], Path(workdir) / "one"))
    floor = ray_floor(EXPERIMENT)
    figures = {
        "pipeline": run,
        "plain_loop": loop,
        "pipeline_1_worker_2_threads": one,
        "ray_floor_startup_s": floor,
        "startup_over_floor": round(run["startup_s"] / floor, 2),
        "samples_s_ratio": [round(p / q, 3) for p, q in zip(run["samples_s"], loop["samples_s"])],
        "val_accuracy_gap": round(run["val_accuracy"] - loop["val_accuracy"], 4),
        "one_worker_over_plain": [round(p / q, 3) for p, q in zip(one["samples_s"], loop["samples_s"])],
    }
    rows = [
        (
            "pipeline (2 workers x 1 thread)",
            *run["samples_s"],
            run["val_accuracy"],
            run["startup_s"],
            run["data_wait_fraction"],
        ),
        ("plain PyTorch loop (2 threads)", *loop["samples_s"], loop["val_accuracy"], "", ""),
        (
            "pipeline / plain",
            *(f"{r}x" for r in figures["samples_s_ratio"]),
            f"{figures['val_accuracy_gap']:+}",
            "",
            "",
        ),
        (
            "pipeline, 1 worker x 2 threads",
            *one["samples_s"],
            one["val_accuracy"],
            one["startup_s"],
            one["data_wait_fraction"],
        ),
        ("1 worker x 2 threads / plain", *(f"{r}x" for r in figures["one_worker_over_plain"]), "", "", ""),
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
