"""What reusing one Ray runtime saves in a sweep: a 4-job `smoke` grid as one Hydra multirun
against the same 4 jobs as separate `python -m pipeline` runs, side by side in one invocation.

    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 PIPELINE_DATA_DIR=../shared/data python bench/sweep_overhead.py

Prints a table and writes outputs/bench/sweep_overhead.json (figures, machine, versions, commit).
"""

from __future__ import annotations

import itertools
import subprocess
import sys
import tempfile
import time

from report import data_dir, table, write

GRID = {"optim.lr": ["1e-3", "3e-4"], "train.epochs": ["1", "2"]}


def timed(args: list[str], cwd: str) -> float:
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "pipeline", *args],
        cwd=cwd,
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return time.perf_counter() - start


def main() -> None:
    data_dir()
    with tempfile.TemporaryDirectory() as workdir:
        sweep_s = timed(["-m", "+experiment=smoke", *(f"{k}={','.join(v)}" for k, v in GRID.items())], workdir)
        jobs = [[f"{k}={v}" for k, v in zip(GRID, values)] for values in itertools.product(*GRID.values())]
        single_s = [timed(["+experiment=smoke", *job], workdir) for job in jobs]
    figures = {
        "jobs": len(jobs),
        "sweep_s": round(sweep_s, 1),
        "singles_s": round(sum(single_s), 1),
        "singles_each_s": [round(s, 1) for s in single_s],
        "saved_per_job_s": round((sum(single_s) - sweep_s) / len(jobs), 1),
        "singles_over_sweep": round(sum(single_s) / sweep_s, 2),
    }
    print(
        table(
            [("one multirun (-m)", figures["sweep_s"]), ("4 separate runs", figures["singles_s"])],
            ("4-job smoke grid", "wall s"),
        )
    )
    print(f"saved per job: {figures['saved_per_job_s']} s; separate / multirun = {figures['singles_over_sweep']}x")
    write("sweep_overhead", figures)


if __name__ == "__main__":
    main()
