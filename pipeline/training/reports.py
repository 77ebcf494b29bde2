"""What a training worker reports to Ray Train, with a checkpoint: each epoch's metrics (:func:`report`), and the
checkpoints within an epoch (:class:`StepCheckpoints`: ``train.checkpoint_every``, a stop with notice, a draining
node); and rank 0's record of each report, with the steps it logged since the record before, which outlives the
checkpoint (:mod:`pipeline.training.records`)."""

from __future__ import annotations

import os
import tempfile
import threading
from dataclasses import dataclass, field

import numpy as np
import ray
import ray.train
from ray.train import CheckpointUploadMode

from pipeline.config import CheckpointUpload, PipelineConfig
from pipeline.runtime.filesystems import RunStorage
from pipeline.training import checkpoint, parallel, preemption, records
from pipeline.training.early_stop import EarlyStopping
from pipeline.training.events import STEP_KEY, StepCheckpointed
from pipeline.training.ledger import Ledger
from pipeline.training.local_mode import LocalReports
from pipeline.training.replica import Replica
from pipeline.training.telemetry import EpochTelemetry


def report(
    metrics: dict,
    replica: Replica,
    epoch: int,
    stopper: EarlyStopping | None,
    rank: int,
    upload: str,
    *,
    storage: RunStorage,
    steps: list[tuple[int, float, float]],
    position: tuple[np.ndarray, dict] | None = None,
    local: LocalReports | None = None,
) -> None:
    """``ray.train.report`` (a barrier: every rank calls it once per epoch, and at each checkpoint within it) with
    the checkpoint, written to a local directory that Ray Train uploads to storage and then deletes: with
    ``upload`` async (``train.checkpoint_upload``) in a thread while training goes on. Every rank's files and their
    sizes go in rank 0's report, so a checkpoint cut short is never taken for whole (:func:`checkpoint.newest`).
    First, rank 0's record of the report and its logged ``steps`` goes to the run's ``storage``. ``position``: a
    checkpoint within the epoch, the rows trained on and the epoch's figures so far. ``local``: a run in Ray Train's
    local mode, whose report this call persists and relays (:mod:`pipeline.training.local_mode`)."""
    if rank == 0:
        records.write(storage, metrics, steps)
    directory = tempfile.mkdtemp(prefix="checkpoint-")
    replica.save(directory, epoch, stopper, rank)
    if position is not None and rank == 0:
        checkpoint.write_position(directory, *position)
    every_rank = parallel.from_every_rank(checkpoint.files(directory))
    written = {name: size for files in every_rank for name, size in files.items()}
    if rank == 0:
        checkpoint.write_report(directory, metrics, written)
    if local is not None:  # synchronous: the one worker's copy is the driver's process's
        ray.train.report(metrics, checkpoint=local.persist(directory, metrics))
        return
    saved = None
    if os.listdir(directory):
        saved = ray.train.Checkpoint.from_directory(directory)
    else:  # a replica's rank other than 0: nothing to upload
        os.rmdir(directory)
    mode = CheckpointUploadMode.ASYNC if upload == CheckpointUpload["async"] else CheckpointUploadMode.SYNC
    ray.train.report(metrics, checkpoint=saved, checkpoint_upload_mode=mode, delete_local_checkpoint_after_upload=True)


@dataclass(kw_only=True)
class StepCheckpoints:
    """A worker's checkpoints within an epoch (``train.checkpoint_every``, a stop with notice): when one is due
    (:class:`pipeline.training.preemption.Due`), what it keeps, and the answer to the driver's notice."""

    due: preemption.Due
    replica: Replica
    stopper: EarlyStopping | None
    cfg: PipelineConfig
    rank: int
    storage: RunStorage  # the run's: each report's record goes there
    local: LocalReports | None = None  # a run in Ray Train's local mode: its reports persisted and relayed here
    logged: list[tuple[int, float, float]] = field(default_factory=list)  # rank 0's train_loss_step records

    def carried(self) -> list[tuple[int, float, float]]:
        """The logged steps (global step, loss, time) since the last report, for its record: the driver logs from
        the records any still on their way when it died."""
        carried, self.logged = self.logged, []
        return carried

    @property
    def notice_seen(self) -> threading.Event | None:
        """Set once the driver's notice is seen: validation stops reading at it, except a sharded model's (its
        ranks gather each forward's weights together, so none may stop on its own)."""
        return None if parallel.is_sharded(self.replica.model) else self.due.stopping

    def taken(
        self, *, epoch: int, step: int, global_step: int, updates: int, within: tuple[EpochTelemetry, Ledger]
    ) -> bool:
        """After batch ``step`` of ``epoch``, the run's optimizer step ``updates``: a checkpoint when one is due; True
        when the command is stopping (it is saved, and the driver told)."""
        due, stopping = self.due.check(updates)
        if due:
            self.save(epoch=epoch, step=step, global_step=global_step, within=within, stopping=stopping)
        return stopping

    def save(
        self, *, epoch: int, step: int, global_step: int, within: tuple[EpochTelemetry, Ledger], stopping: bool = True
    ) -> None:
        """The checkpoint after ``step`` of ``epoch`` (a collective), the driver told when the command is stopping."""
        train = self.cfg.train
        telemetry, ledger = within
        why = preemption.STOPPING if stopping else self.due.why  # a stop seen in validation comes after the last check
        metrics = {"epoch": epoch, STEP_KEY: step, "global_step": global_step, "rank": self.rank, "why": why}
        if train.checkpoint_metric is not None:
            metrics[train.checkpoint_metric] = checkpoint.unscored(train, self.cfg.task)
        upload = CheckpointUpload.sync if stopping else train.checkpoint_upload  # the process ends next
        position = ledger.trained(), telemetry.carried()  # collectives: every rank
        report(
            metrics,
            self.replica,
            epoch,
            self.stopper,
            self.rank,
            upload,
            storage=self.storage,
            steps=self.carried(),
            position=position,
            local=self.local,
        )
        self.due.saved()
        if stopping and self.rank == 0 and self.due.notice is not None:  # the driver waits for it
            saved = StepCheckpointed(epoch=epoch, step=step, global_step=global_step, checkpoint=None)
            ray.get(self.due.notice.checkpointed.remote(saved))
