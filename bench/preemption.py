"""Goodput under preemption: the share of the workers' time spent on steps that count, for a run preempted about
every ``--interval`` seconds (SIGTERM, as a spot notice or ``ray job stop`` sends it) and resumed each time, with
the checkpoint at the step the notice found (the default, ``train.checkpoint_on_stop``) against resuming from the
last epoch's checkpoint (``train.checkpoint_on_stop=false``, as before).

The run: the smoke ViT on real CIFAR-10 rows, one worker. An uninterrupted run first gives the seconds its steps
take (first step to last validation); each arm is then started, stopped a drawn wait after each launch (uniform
from half to one and a half ``--interval``, the same draws for both arms) and resumed, until it finishes or has
used ``--cap`` times the uninterrupted run's wall time. Goodput: the steps its newest checkpoint holds, in the
uninterrupted run's seconds, over the wall seconds of every attempt (each holds the workers from launch to exit:
start-up, lost steps and all).

    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 PIPELINE_DATA_DIR=../shared/data python bench/preemption.py

Takes about 15 minutes on 2 cores (an epoch of 50,000 rows: about 37 s of steps). Prints a table and writes
outputs/bench/preemption.json.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow.fs as pafs
from report import bench_env, last_run, pipeline_run, table, write

from pipeline.training import checkpoint
from pipeline.training.events import STEP_KEY

RUN = ["+experiment=smoke", "scaling.num_workers=1", "ingest.batch_size=64", "tracking.log_model=false"]


def attempts(args: list[str], outputs: Path, waits: list[float], budget_s: float, log: Path) -> dict:
    """Run ``args`` until it finishes, attempt ``i`` stopped ``waits[i]`` seconds after its launch and resumed; stop
    trying once ``budget_s`` of attempts are spent. Wall seconds of each attempt, and whether it finished."""
    walls, finished = [], False
    for wait_s in waits:
        if finished or sum(walls) >= budget_s:
            break
        resume = ["train.resume=true"] if walls else []
        argv = [sys.executable, "-m", "pipeline", *args, *resume, f"paths.outputs={outputs}"]
        start = time.perf_counter()
        with open(log, "a") as console:
            env = {**os.environ, **bench_env()}
            process = subprocess.Popen(argv, stdout=console, stderr=subprocess.STDOUT, env=env)
            try:
                process.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                process.send_signal(signal.SIGTERM)
                process.wait(timeout=120)
        walls.append(round(time.perf_counter() - start, 1))
        _, run = last_run(outputs)
        finished = run.info.status == "FINISHED"
    return {"attempt_wall_s": walls, "finished": finished}


def steps_held(outputs: Path, steps_per_epoch: int) -> int:
    """The global steps the run's newest whole checkpoint holds (0: none yet)."""
    _, run = last_run(outputs)
    storage = run.data.tags["pipeline.storage"]
    filesystem, root = pafs.FileSystem.from_uri(storage)
    path = checkpoint.newest(filesystem, root)
    if path is None:
        return 0
    report = checkpoint.read_report(filesystem, path)
    return report["global_step"] if STEP_KEY in report else (report["epoch"] + 1) * steps_per_epoch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--interval", type=float, default=60.0, help="seconds from each launch to its SIGTERM")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--rows", type=int, default=50000, help="training rows (source.limit)")
    parser.add_argument("--cap", type=float, default=2.0, help="an arm stops after this many uninterrupted runs' time")
    parser.add_argument("--seed", type=int, default=0, help="draws the waits before each preemption")
    options = parser.parse_args()
    waits = [round(w, 1) for w in np.random.default_rng(options.seed).uniform(0.5, 1.5, 100) * options.interval]
    args = [*RUN, f"train.epochs={options.epochs}", f"source.limit={options.rows}"]
    steps_per_epoch = -(-options.rows // 64)  # ingest.drop_last=false: the last batch is partial
    figures: dict = {
        "interval_s": options.interval,
        "seed": options.seed,
        "epochs": options.epochs,
        "rows": options.rows,
    }
    with tempfile.TemporaryDirectory() as workdir:
        work = Path(workdir)
        straight = pipeline_run([*args, "tracking.run_name=straight"], work / "straight", log=work / "straight.log")
        useful_s = straight["to_validation_s"] - straight["startup_s"]
        figures["uninterrupted"] = {**straight, "useful_s": round(useful_s, 1)}
        rows = [("uninterrupted", 1, straight["wall_s"], "yes", "100%", f"{useful_s / straight['wall_s']:.0%}")]
        for arm, on_stop in (("step checkpoint on the notice", "true"), ("epoch checkpoints only", "false")):
            outputs = work / on_stop
            tried = attempts(
                [*args, f"train.checkpoint_on_stop={on_stop}", "tracking.run_name=preempted"],
                outputs,
                waits,
                options.cap * straight["wall_s"],
                work / f"{on_stop}.log",
            )
            held = steps_held(outputs, steps_per_epoch) / (options.epochs * steps_per_epoch)
            goodput = held * useful_s / sum(tried["attempt_wall_s"])
            figures[arm] = {**tried, "share_of_steps_held": round(held, 3), "goodput": round(goodput, 3)}
            done, wall = ("yes" if tried["finished"] else "no"), round(sum(tried["attempt_wall_s"]), 1)
            rows.append((arm, len(tried["attempt_wall_s"]), wall, done, f"{held:.0%}", f"{goodput:.0%}"))
    print(table(rows, ("run", "attempts", "wall s", "finished", "steps held", "goodput")))
    write("preemption", figures)


if __name__ == "__main__":
    main()
