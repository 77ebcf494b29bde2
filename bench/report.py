"""What every benchmark records beside its figures: the machine, the versions and the commit."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

from mlflow import MlflowClient

OUT_DIR = Path("outputs/bench")
PACKAGES = ("ray", "torch", "torchvision", "pyarrow", "hydra-core", "mlflow")


def data_dir() -> str:
    """The real data (``PIPELINE_DATA_DIR``, default ../shared/data), as an absolute path for every process."""
    path = str(Path(os.environ.get("PIPELINE_DATA_DIR", "../shared/data")).resolve())
    os.environ["PIPELINE_DATA_DIR"] = path
    return path


def write(name: str, figures: dict) -> Path:
    """Write ``outputs/bench/<name>.json`` and return its path."""
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    report = {
        "figures": figures,
        "commit": commit,
        "versions": {p: version(p) for p in PACKAGES},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "processor": platform.processor()},
    }
    out = OUT_DIR / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    return out


def table(rows: list[tuple], header: tuple) -> str:
    """A plain text table: the first column left-aligned, the others right-aligned."""
    cells = [tuple(str(c) for c in row) for row in [header, *rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return "\n".join(
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in cells
    )


def pipeline_run(args: list[str], outputs: Path, env: dict | None = None, log: Path | None = None) -> dict:
    """Run ``python -m pipeline ARGS`` as a user does; its figures come back from the MLflow run it logged
    in ``outputs``: samples/s, data_wait_fraction and val_accuracy per epoch, startup_s (command to first
    training step), the cache's build seconds (when it cached) and the command's wall time. The command's
    console goes to ``log`` when given."""
    start = time.perf_counter()
    with open(log, "w") if log else open(os.devnull, "w") as console:
        done = subprocess.run(
            [sys.executable, "-m", "pipeline", *args, f"paths.outputs={outputs}"],
            stdout=console,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )
    if done.returncode:
        said = log.read_text()[-3000:] if log else ""
        raise RuntimeError(f"python -m pipeline {' '.join(args)} exited {done.returncode}:\n{said}")
    wall = time.perf_counter() - start
    client, run = last_run(outputs)

    def history(key: str) -> list[float]:
        return metric_history(client, run, key)

    return {
        "samples_s": [round(v) for v in history("train_throughput")],
        "data_wait_fraction": [round(v, 3) for v in history("data_wait_fraction")],
        "val_accuracy": [round(v, 4) for v in history("val_accuracy")],
        "label_mix": [round(v, 3) for v in history("label_mix")],
        "startup_s": round(history("startup_s")[0], 1),
        "cache_train_s": [round(v, 1) for v in history("cache_train_s")],
        "wall_s": round(wall, 1),
    }


def last_run(outputs: Path):
    """The MLflow client of the store in ``outputs`` and the newest run there."""
    client = MlflowClient(f"sqlite:///{outputs / 'mlflow.db'}")
    experiments = [e.experiment_id for e in client.search_experiments()]
    return client, client.search_runs(experiments, order_by=["start_time DESC"])[0]


def metric_history(client: MlflowClient, run, key: str) -> list[float]:
    """A run's values of ``key``, by step."""
    return [m.value for m in sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)]


def ray_floor(overrides: list[str]) -> float:
    """Seconds from command to first batch for Ray Train + Ray Data alone (``bench/floor.py``, a fresh process),
    for a job of the shape ``overrides`` give: its workers, CPUs per worker, a training and a validation dataset."""
    from pipeline.api import compose

    scaling = compose(overrides).scaling
    cpus = scaling.resources_per_worker.get("CPU", 1.0)
    shape = ["--workers", str(scaling.max_workers), "--cpus-per-worker", str(cpus), "--datasets", "2"]
    command = [sys.executable, str(Path(__file__).with_name("floor.py")), *shape]
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])["startup_s"]
