"""Every report's record in the run's storage, kept apart from the checkpoint it came with: an epoch's metrics (or
a checkpoint within an epoch's place) and the step losses rank 0 logged since the record before.

Ray Train deletes checkpoints beyond ``train.num_to_keep``, and a report's own copy (``report.json``) goes with its
checkpoint. A driver gone before a report reached it (a signal, a lost machine, the workers training on for
seconds after it) would leave that epoch out of MLflow for good once Ray deleted the checkpoint. A record is a
few hundred bytes and outlives its checkpoint, so the next command on the run (a resume, its end) logs from the
records what MLflow lacks (:meth:`pipeline.tracking.epochs.EpochLog.reconcile`).

A record placed after the checkpoint training restores from is of training that restore abandons: a report Ray Train
skipped (ray 2.60 skips the reports of a worker group it is about to restart, a resize or a lost worker, and the
workers train on), or one whose checkpoint never reached storage. The restoring worker drops those
(:func:`drop_after`) before the driver reconciles: training runs those epochs again and reports them anew.
"""

from __future__ import annotations

import json
import os

import pyarrow.fs as pafs

from pipeline.runtime.filesystems import RunStorage
from pipeline.training.checkpoint import place
from pipeline.training.events import STEP_KEY

RECORDS_DIR = "records"  # in the run's storage, beside Ray Train's checkpoints
STEPS_KEY = "logged_steps"  # in a record: rank 0's step losses since the record before: [global step, loss, time]


def write(storage: RunStorage, metrics: dict, steps: list[tuple[int, float, float]]) -> None:
    """Rank 0's record of a report (``metrics``, with ``steps``), before its checkpoint is reported: named by its
    place in the run, written whole or not at all (a temporary name, then moved)."""
    epoch, step = metrics["epoch"], metrics.get(STEP_KEY)
    name = f"{epoch:06d}-end" if step is None else f"{epoch:06d}-step{step:09d}"
    directory = f"{storage.path}/{storage.name}/{RECORDS_DIR}"
    storage.filesystem.create_dir(directory)
    partial = f"{directory}/.{name}.{os.getpid()}"
    with storage.filesystem.open_output_stream(partial) as out:
        out.write(json.dumps({**metrics, STEPS_KEY: steps}).encode())
    storage.filesystem.move(partial, f"{directory}/{name}.json")


def read(storage: RunStorage) -> list[dict]:
    """Every record of the run, in its place (oldest first)."""
    return [record for _, record in sorted(listed(storage), key=lambda pair: place(pair[1]))]


def drop_after(storage: RunStorage, restored: dict) -> None:
    """Delete the records placed after ``restored``, the report of the checkpoint training continues from."""
    for path, record in listed(storage):
        if place(record) > place(restored):
            storage.filesystem.delete_file(path)


def listed(storage: RunStorage) -> list[tuple[str, dict]]:
    """Each record of the run with its path."""
    directory = f"{storage.path}/{storage.name}/{RECORDS_DIR}"
    found = []
    for info in storage.filesystem.get_file_info(pafs.FileSelector(directory, allow_not_found=True)):
        if info.base_name.endswith(".json"):
            with storage.filesystem.open_input_stream(info.path) as stream:
                found.append((info.path, json.loads(stream.read())))
    return found
