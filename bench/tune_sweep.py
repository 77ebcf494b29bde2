"""One 4-trial sweep three ways, side by side in one invocation: Hydra's basic launcher (one trial after
another, one Ray runtime), Ray Tune with 2 trials at once and every trial run to the end, and Ray Tune
with 2 at once and ASHA stopping the worst early. Real CIFAR-10, the `smoke` ViT on one worker.

    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 PIPELINE_DATA_DIR=../shared/data python bench/tune_sweep.py

Prints wall time and the best val_accuracy per way, and writes outputs/bench/tune_sweep.json.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mlflow import MlflowClient
from report import data_dir, table, write

SWEEP = [
    "+experiment=smoke",
    "optim.lr=3e-3,1e-3,3e-4,0",  # lr=0 the clearly bad trial
    "train.epochs=3",
    "scaling.num_workers=1",
    "ray.num_cpus=4",  # logical CPUs: room for two trials' workers and their data tasks on 2 cores
]
TUNE = ["hparams_search=tune", "hydra.sweeper.num_samples=1", "hydra.sweeper.max_concurrent_trials=2"]
WAYS = {
    "basic launcher, 1 at a time": [],
    "Tune, 2 at once, no early stop": [*TUNE, "hydra/sweeper/scheduler=fifo"],
    "Tune, 2 at once, ASHA": TUNE,
}


def timed_sweep(extra: list[str], workdir: Path) -> dict:
    """Wall time of the whole command, and what its sweep's parent run recorded."""
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "pipeline", "-m", *SWEEP, *extra, "hydra.sweep.dir=sweep"],
        cwd=workdir,
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wall = time.perf_counter() - start
    client = MlflowClient(f"sqlite:///{workdir / 'outputs' / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("smoke").experiment_id
    runs = client.search_runs([experiment])
    (parent,) = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    epochs = sum(len(client.get_metric_history(r.info.run_id, "val_accuracy")) for r in runs if r is not parent)
    return {
        "wall_s": round(wall, 1),
        "best_val_accuracy": round(parent.data.metrics["best_val_accuracy"], 4),
        "epochs_trained": epochs,
    }


def main() -> None:
    data_dir()
    figures = {}
    for name, extra in WAYS.items():
        with tempfile.TemporaryDirectory() as workdir:
            figures[name] = timed_sweep(extra, Path(workdir))
        print(f"{name}: {figures[name]}", flush=True)
    basic = figures["basic launcher, 1 at a time"]["wall_s"]
    rows = [
        (name, f["wall_s"], f"{basic / f['wall_s']:.2f}x", f["best_val_accuracy"], f["epochs_trained"])
        for name, f in figures.items()
    ]
    print(table(rows, ("4-trial smoke sweep", "wall s", "speed-up", "best val_acc", "epochs run")))
    write("tune_sweep", {"sweep": SWEEP, "ways": figures})


if __name__ == "__main__":
    main()
