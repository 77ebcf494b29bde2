"""Runs in the one training worker of a run in Ray Train's local mode (``ScalingConfig(num_workers=0)``: the worker
is the driver's own process, with no controller and no worker group to start).

Ray 2.60's local mode keeps each report in memory only (``LocalTrainFnUtils.report`` holds the last one), and has
no controller to run callbacks. What the controller does with a worker group's report is done here, in the
worker's own call (:class:`LocalReports`): the checkpoint copied to the run's storage, where Ray Train puts one;
``train.num_to_keep`` kept as Ray Train's checkpoint manager keeps them (the best by ``train.checkpoint_metric``,
and always the latest); the report handed to the driver's events, as :class:`pipeline.training.relay.ReportRelay`
hands it. Resuming reads the newest whole checkpoint in storage (:mod:`pipeline.training.resume`), as it does
after a worker group. Canary of the behaviour: ``tests/test_ray_canaries.py``.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import pyarrow.fs as pafs
import ray.train

from pipeline.runtime.filesystems import RunStorage
from pipeline.training import checkpoint
from pipeline.training.relay import reported

CHECKPOINT_DIR = "checkpoint_%Y-%m-%d_%H-%M-%S.%f"  # Ray Train's name for a checkpoint's directory in storage


@dataclass(frozen=True, kw_only=True)
class LocalReports:
    """Where a local-mode run's checkpoints go (``storage``), how many stay (``num_to_keep``, ranked by ``metric``
    in ``mode``), and the driver's ``events`` queue."""

    storage: RunStorage
    num_to_keep: int | None
    metric: str | None
    mode: str  # "min" or "max"
    events: Any  # the ray.util.queue.Queue the driver reads the workers' events from

    def persist(self, directory: str, metrics: dict) -> ray.train.Checkpoint:
        """The checkpoint written to the local ``directory`` with ``metrics``, copied to the run's storage (the
        local copy then deleted), the checkpoints beyond ``num_to_keep`` deleted, and the report sent to the driver:
        the checkpoint in storage."""
        filesystem, run = self.storage.filesystem, f"{self.storage.path}/{self.storage.name}"
        target = f"{run}/{datetime.now().strftime(CHECKPOINT_DIR)}"
        filesystem.create_dir(target)
        pafs.copy_files(directory, target, destination_filesystem=filesystem)
        shutil.rmtree(directory)
        self.keep(run, target)
        self.events.put(reported([metrics], target))
        return ray.train.Checkpoint(target, filesystem=filesystem)

    def keep(self, run: str, latest: str) -> None:
        """Ray Train's rule: the ``num_to_keep`` best by ``metric`` (the newest, without one), and the ``latest``."""
        if self.num_to_keep is None:
            return
        found = checkpoint.reports(self.storage.filesystem, run)  # oldest first
        ranked = [path for path, _ in reversed(found)]
        if self.metric is not None:
            sign = -1.0 if self.mode == "max" else 1.0
            scored = [(sign * report[self.metric], path) for path, report in found if self.metric in report]
            ranked = [path for _, path in sorted(scored, key=lambda pair: pair[0])]
        kept = {*ranked[: self.num_to_keep], latest}
        for path, _ in found:
            if path not in kept:
                self.storage.filesystem.delete_dir(path)
