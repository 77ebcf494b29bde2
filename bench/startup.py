"""The first minute: ``python -m pipeline +experiment=smoke``'s start-up (``startup_s``: command to first training
step, and when each of its phases ended), on one worker (in the driver's process: Ray Train's local mode, which
``scaling.local_mode=auto`` takes) and on the experiment's two workers (a worker group), against, in interleaved
rounds so all see the machine in the same state:

- the plain loop on the same rows and model (``bench/plain.py``, its rows decoded in memory first, clocked from its
  process's start): the bar;
- Ray's floor for a job of the same shape (``bench/floor.py``: two workers of half a CPU, a training and a
  validation dataset, the first batch of a range dataset): what Ray Train and Ray Data cost before any work;
- the same floor in Ray Train's local mode (``num_workers=0``: the training function in the driver, no controller,
  no worker group): what dropping the worker group (and its restarts) would save.

The pipeline's runs share one MLflow store, as a user's runs in a project do (the first run of a project
creates it: about a CPU-second more, while Ray starts).

    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 PIPELINE_DATA_DIR=../shared/data python bench/startup.py [ROUNDS]

About 100 s per round on 2 cores. Prints a table and writes outputs/bench/startup.json.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

from mlflow import MlflowClient
from report import data_dir, pipeline_run, plain_run, ray_floor, table, write

ONE_WORKER = ["+experiment=smoke"]  # smoke trains on one worker
EXPERIMENT = [*ONE_WORKER, "scaling.num_workers=2"]  # the worker group Ray's floor is taken for
COLUMNS = {  # the table's column: the record's key
    "pipeline, one worker": "pipeline_startup_s",
    "pipeline, two workers": "pipeline_two_workers_startup_s",
    "plain loop": "plain_startup_s",
    "Ray's floor": "floor_startup_s",
    "Ray's floor, local mode": "local_mode_floor_startup_s",
}


def main(rounds: int) -> None:
    data_dir()
    figures: dict[str, list] = {column: [] for column in COLUMNS}
    phases: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory() as outputs:
        MlflowClient(f"sqlite:///{outputs}/mlflow.db").search_experiments()  # the project's store, made once
        for _ in range(rounds):
            ours = pipeline_run(ONE_WORKER, Path(outputs))
            figures["pipeline, one worker"].append(ours["startup_s"])
            phases.append(ours["startup_phases"])
            figures["pipeline, two workers"].append(pipeline_run(EXPERIMENT, Path(outputs))["startup_s"])
            figures["plain loop"].append(plain_run("decoded", "pipeline", ONE_WORKER)["startup_s"])
            figures["Ray's floor"].append(ray_floor(EXPERIMENT))
            figures["Ray's floor, local mode"].append(ray_floor(EXPERIMENT, local_mode=True))
    rows = [(f"round {i + 1}", *(figures[c][i] for c in COLUMNS)) for i in range(rounds)]
    rows.append(("mean", *(round(statistics.mean(values), 1) for values in figures.values())))
    print(table(rows, ("+experiment=smoke, s to the first step", *COLUMNS)))
    phase_means = {phase: round(statistics.mean(p[phase] for p in phases), 1) for phase in phases[0]}
    print("pipeline's phases, one worker (mean, s from the command):", phase_means)
    gaps = [ours - plain for ours, plain in zip(figures["pipeline, one worker"], figures["plain loop"])]
    record = {COLUMNS[column]: values for column, values in figures.items()}
    write("startup", {**record, "phases_mean": phase_means, "after_plain_s": [round(g, 1) for g in gaps]})


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
