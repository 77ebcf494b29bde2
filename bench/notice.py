"""What a stop with notice has time for: a run whose checkpoint is about 400 MB (``bench/checkpoint.py``'s wide MLP,
AdamW's moments included) is sent SIGTERM mid-run, as ``ray job stop``, Slurm, Kubernetes or a spot notice send it,
with ``train.stop_grace_s`` far above any route's so the whole checkpoint is timed: seconds from the signal to the
console's ``stopping: checkpointed`` (the workers agreed on a step, saved, and their upload to storage is done) and to
the command's exit, for the run's storage on local disk and on S3 (moto, on loopback), interleaved. Each stop's
checkpoint is then looked up in storage: a step checkpoint whose files are all there at their written sizes.

Set beside each route's wait between its SIGTERM and its SIGKILL (the table in ``ROUTES``), this says which routes
a checkpoint of this size fits on this machine, and what ``train.stop_grace_s``'s default should be.

    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 python bench/notice.py [--tries 2] [--after 4]

Takes about 4 minutes on 2 cores with two tries. Prints two tables and writes outputs/bench/notice.json.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pyarrow.fs as pafs
from checkpoint import WIDE, moto_s3
from report import bench_env, table, write

from pipeline.training import checkpoint, preemption
from pipeline.training.events import STEP_KEY

# Each route's seconds from its SIGTERM to its SIGKILL, by its default (the documented figure).
ROUTES = {
    "ray job stop (RAY_JOB_STOP_WAIT_TIME_S)": 3,
    "Slurm (KillWait)": 30,
    "Kubernetes (terminationGracePeriodSeconds)": 30,
    "GCP spot / preemptible VM": 30,
    "AWS spot (interruption notice)": 120,
}
RUN = [arg for arg in WIDE if not arg.startswith("train.epochs=")] + [
    "train.epochs=200",  # far more than the stop leaves time for
    "train.checkpoint_every=null",  # no checkpoint within an epoch but the notice's
    "train.stop_grace_s=600",  # the whole checkpoint timed, whatever it takes
]


class Console(threading.Thread):
    """A command's console lines, each with the monotonic time it came."""

    def __init__(self, process: subprocess.Popen) -> None:
        super().__init__(daemon=True)
        self.process, self.lines = process, []

    def run(self) -> None:
        for line in self.process.stdout:
            self.lines.append((time.monotonic(), line))

    def first(self, text: str) -> float | None:
        return next((at for at, line in list(self.lines) if text in line), None)


def stopped_run(storage: str, outputs: Path, after_s: float) -> dict:
    """One command on ``storage``, SIGTERM ``after_s`` seconds after its first training step; its timings."""
    argv = [sys.executable, "-m", "pipeline", *RUN, f"storage.path={storage}", f"paths.outputs={outputs}"]
    env = {**os.environ, **bench_env()}
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    console = Console(process)
    console.start()
    try:
        while console.first("start-up:") is None:
            if process.poll() is not None:
                raise RuntimeError("".join(line for _, line in console.lines)[-3000:])
            time.sleep(0.1)
        time.sleep(after_s)
        signalled = time.monotonic()
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=600)
        exited = time.monotonic()
    finally:
        process.kill()
    console.join(timeout=10)
    checkpointed = console.first("stopping: checkpointed")
    return {
        "checkpointed_s": None if checkpointed is None else round(checkpointed - signalled, 2),
        "exit_s": round(exited - signalled, 2),
        "returncode": process.returncode,
    }


def notice_checkpoint(fs: pafs.FileSystem, root: str) -> dict:
    """The stop's checkpoint under ``root``: whether it is whole, its size."""
    directories = [
        info.path.rsplit("/", 1)[0]
        for info in fs.get_file_info(pafs.FileSelector(root, recursive=True))
        if info.base_name == "report.json"
    ]
    for directory in directories:
        report = checkpoint.read_report(fs, directory)
        if STEP_KEY in report and report.get("why") == preemption.STOPPING:
            size = sum(i.size for i in fs.get_file_info(pafs.FileSelector(directory)) if i.is_file)
            return {"whole": checkpoint.whole(fs, directory, report), "mb": round(size / 1e6)}
    return {"whole": False, "mb": 0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tries", type=int, default=2, help="stops per storage, interleaved")
    parser.add_argument("--after", type=float, default=4.0, help="seconds after the first step the SIGTERM comes")
    args = parser.parse_args()
    rows = []
    with moto_s3() as s3, tempfile.TemporaryDirectory() as workdir:
        os.environ.setdefault("PIPELINE_DATA_DIR", str(Path(workdir) / "data"))  # wine is written there
        local = pafs.LocalFileSystem()
        for i in range(args.tries):
            for name, fs, storage, root in (
                ("local disk", local, f"{workdir}/local{i}", f"{workdir}/local{i}"),
                ("S3 (moto, loopback)", s3, f"s3://runs/try{i}", f"runs/try{i}"),
            ):
                run = stopped_run(storage, Path(workdir) / f"outputs{i}", args.after)
                rows.append({"storage": name, "try": i, **run, **notice_checkpoint(fs, root)})
                print(rows[-1], flush=True)
    columns = ("storage", "try", "to checkpointed s", "to exit s", "exit code", "whole", "checkpoint MB")
    print(table([tuple(row.values()) for row in rows], columns))
    worst = {
        name: max((row["checkpointed_s"] or float("inf")) for row in rows if row["storage"] == name)
        for name in {row["storage"] for row in rows}
    }
    fits = [
        (route, wait, *("yes" if worst[name] < wait else "no" for name in sorted(worst)))
        for route, wait in ROUTES.items()
    ]
    print(table(fits, ("route", "SIGKILL after s", *(f"fits: {name}" for name in sorted(worst)))))
    write("notice", {"slowest_checkpointed_s": worst, "routes": ROUTES}, rows)


if __name__ == "__main__":
    main()
