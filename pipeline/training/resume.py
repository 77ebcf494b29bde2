"""Runs in every training worker: where a worker group (started, restarted, resumed) continues, and the steps
of each epoch from there. The newest checkpoint is the newer of what Ray Train restores and the newest whole one in
the run's storage; taken within an epoch, it says the steps done and the rows trained on
(:mod:`pipeline.training.ledger`), and that epoch goes on after them, on any number of workers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import ray.train

from pipeline.config import PipelineConfig
from pipeline.runtime.filesystems import RunStorage
from pipeline.training import checkpoint
from pipeline.training.events import STEP_KEY


def steps_per_epoch(train_rows: int, num_workers: int, global_batch: int, drop_last: bool) -> int:
    """Batches each worker sees per epoch: Ray Train splits a dataset into equal shards."""
    rows, batch = train_rows // num_workers, global_batch // num_workers
    return rows // batch if drop_last else -(-rows // batch)


@dataclass(frozen=True, kw_only=True)
class RestorePoint:
    """A checkpoint to continue from: its epoch and, taken within it, the steps done (``step``), the rows trained
    on (packed bits) and the epoch's figures so far; ``step`` 0: at the epoch's end."""

    checkpoint: ray.train.Checkpoint
    report: dict
    step: int = 0
    trained: np.ndarray | None = None
    figures: dict | None = None

    @property
    def next_epoch(self) -> int:
        return self.report["epoch"] + (0 if self.step else 1)

    @property
    def trained_rows(self) -> int:
        return int(np.unpackbits(self.trained).sum()) if self.trained is not None else 0


def restore_point(storage: RunStorage) -> RestorePoint | None:
    """Where training continues: the newer of the checkpoint Ray Train restores (a restarted worker group, or
    a resumed run) and the newest whole one in the run's ``storage``, which Ray may not have registered yet (a
    stop between its copy and its registration, a worker lost before the controller took its last report).
    Their reports say where they stand."""
    path = checkpoint.newest(storage.filesystem, f"{storage.path}/{storage.name}")
    saved = None if path is None else ray.train.Checkpoint(path, filesystem=storage.filesystem)
    found = [ray.train.get_checkpoint(), saved]
    reports = [(point, checkpoint.read_report(point.filesystem, point.path)) for point in found if point is not None]
    if not reports:
        return None
    newest, report = max(reports, key=lambda pair: checkpoint.place(pair[1]))
    if STEP_KEY not in report:
        return RestorePoint(checkpoint=newest, report=report)
    trained, figures = checkpoint.read_position(newest.filesystem, newest.path)
    return RestorePoint(checkpoint=newest, report=report, step=report[STEP_KEY], trained=trained, figures=figures)


@dataclass(frozen=True, kw_only=True)
class EpochSteps:
    """An epoch's steps on this worker: ``done`` before a resume, the ``last``, and ``per_epoch`` of an
    uninterrupted epoch (what the global step counts in)."""

    done: int
    last: int
    per_epoch: int

    @classmethod
    def of(cls, cfg: PipelineConfig, rows: int, world_size: int, resumed: RestorePoint | None) -> EpochSteps:
        """An epoch of the training split's ``rows`` on ``world_size`` workers, ``resumed`` within it or not."""
        batch, drop_last = cfg.ingest.batch_size, cfg.ingest.drop_last
        done, left = (resumed.step, rows - resumed.trained_rows) if resumed else (0, rows)
        per_epoch = steps_per_epoch(rows, world_size, batch, drop_last)
        return cls(done=done, last=done + steps_per_epoch(left, world_size, batch, drop_last), per_epoch=per_epoch)
