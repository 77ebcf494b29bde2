"""The first minute: ``python -m pipeline +experiment=smoke``'s start-up (``startup_s``: command to first training
step) against Ray's floor for a job of the same shape (``bench/floor.py``: two workers of half a CPU, a
training and a validation dataset), in interleaved pairs, so both see the machine in the same state.

The pipeline's runs share one MLflow store, as a user's runs in a project do (the first run of a project
creates it: about a CPU-second more, while Ray starts).

    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 PIPELINE_DATA_DIR=../shared/data python bench/startup.py [PAIRS]

About a minute per pair on 2 cores. Prints a table and writes outputs/bench/startup.json.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from mlflow import MlflowClient
from report import data_dir, pipeline_run, ray_floor, table, write

EXPERIMENT = ["+experiment=smoke"]


def main(pairs: int) -> None:
    data_dir()
    rows, figures = [], {}
    with tempfile.TemporaryDirectory() as outputs:
        MlflowClient(f"sqlite:///{outputs}/mlflow.db").search_experiments()  # the project's store, made once
        for pair in range(pairs):
            ours = pipeline_run(EXPERIMENT, Path(outputs))["startup_s"]
            floor = ray_floor(EXPERIMENT)
            rows.append((f"pair {pair + 1}", ours, floor, f"{ours / floor:.2f}x"))
            figures.setdefault("pipeline_startup_s", []).append(ours)
            figures.setdefault("floor_startup_s", []).append(floor)
    ratios = [p / f for p, f in zip(figures["pipeline_startup_s"], figures["floor_startup_s"])]
    figures["ratio"] = [round(r, 2) for r in ratios]
    figures["ratio_mean"] = round(sum(ratios) / len(ratios), 2)
    rows.append(("mean", "", "", f"{figures['ratio_mean']}x"))
    print(table(rows, ("+experiment=smoke", "pipeline startup_s", "Ray's floor (same shape)", "ratio")))
    write("startup", figures)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
