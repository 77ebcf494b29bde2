"""Each epoch of a training run in MLflow exactly once: from the workers' reports, from the workers' records of
those that never reached the driver (:meth:`EpochLog.reconcile`), and across restores, where training runs an
epoch again that MLflow already holds."""

from __future__ import annotations

import logging
import math

from pipeline.common import startup
from pipeline.common.console import data_wait_note
from pipeline.common.errors import PipelineError
from pipeline.config import TrackingConfig
from pipeline.runtime.filesystems import RunStorage
from pipeline.tracking.delivery import metrics_record
from pipeline.tracking.record import RunRecord
from pipeline.training import checkpoint, records
from pipeline.training.events import STEP_KEY

log = logging.getLogger(__name__)

STOPPED_TAG = "pipeline.stopped_early"  # a run that train.early_stop or a Tune scheduler stopped: when, and why
RESTORES_METRIC = "restores"  # count of restores from a checkpoint; step = the epoch training continued at
CHECKPOINT_STEP_METRIC = "checkpoint_step"  # a checkpoint within an epoch: its global step (also the metric's step)
RESTORED_STEP_METRIC = "restored_at_step"  # the global step a restore continued from; step = the restore's count
STEP_LOSS_METRIC = "train_loss_step"  # rank 0's batch loss every tracking.log_every_n_steps; step = global step
DATA_WAIT_TAG = "pipeline.data_wait"  # the latest epoch whose training waited for data, and what to raise


def logged_epochs(client, run_id: str) -> set[int]:
    """Epochs whose metrics the run already holds (a resumed run continues after them)."""
    return {m.step for m in client.get_metric_history(run_id, "train_loss")}


def expected_rows(rows: dict[str, int], num_workers: int, drop_last: bool) -> dict[str, int]:
    """Rows an epoch on ``num_workers`` workers must deliver, by metric, beyond what sharding drops by design:
    Ray Train's equal split drops up to N-1 rows per split, and ``drop_last`` the partial training batches
    (then only validation is counted). Fewer means a transform skipped rows."""
    dropped = num_workers - 1
    expected = {"val_rows": rows["valid"] - dropped}
    if not drop_last:
        expected["train_rows"] = rows["train"] - dropped
    return expected


class EpochLog:
    """A training run's epochs as MLflow holds them: which are logged, which run again, the latest."""

    def __init__(self, record: RunRecord, metrics: list[str], settings: TrackingConfig):
        self.record, self.metrics, self.settings = record, metrics, settings
        self.logged = logged_epochs(record.client, record.run_id)  # a resumed run holds its first epochs already
        self.restores = len(record.client.get_metric_history(record.run_id, RESTORES_METRIC))
        self.rerun: set[int] = set()  # logged epochs that training runs again, restored from an older checkpoint
        self.last: dict | None = None  # the latest epoch's metrics
        self.stopped_early: str | None = None  # why train.early_stop ended training, when it did
        self.rows: dict[str, int] = {}  # rows per split, once the datasets are built
        self.drop_last = False
        self.dataset_of: dict[str, tuple[str, str]] = {}  # metric -> the dataset (name, digest) it was measured on
        self._startup_logged = False
        self.step_checkpoints: set[int] = set()  # global steps of the checkpoints within epochs logged
        # global steps whose train_loss_step the run holds (a resumed run: those its earlier attempts logged)
        self.steps_logged = {m.step for m in record.client.get_metric_history(record.run_id, STEP_LOSS_METRIC)}

    def expect_rows(self, rows: dict[str, int], drop_last: bool) -> None:
        """The rows each split holds: an epoch that delivers fewer logs ``skipped_rows``."""
        self.rows, self.drop_last = rows, drop_last

    def log_startup(self, seconds: dict[str, float], epoch: int) -> None:
        """Once: ``startup_s``, from the command (a sweep's later jobs: their own start) to the first training step,
        and when each phase ended (:func:`pipeline.common.startup.metric`)."""
        if not self._startup_logged:
            phases = {startup.metric(phase): round(s, 3) for phase, s in seconds.items()}
            self.record.write(metrics_record({"startup_s": seconds["first_step"], **phases}, epoch))
            self._startup_logged = True

    def log_epoch(self, metrics: dict, checkpoint: str | None = None) -> None:
        """An epoch's metrics, once (step = epoch), and ``skipped_rows`` when rows went missing; with
        ``tracking.log_model``, its checkpoint (a path in the run's storage) as a LoggedModel they link to."""
        epoch = metrics["epoch"]
        if epoch in self.rerun:  # its record came from its own checkpoint (reconcile), which Ray did not restore
            self.rerun.discard(epoch)
            self.last = metrics
            log.info("epoch %d ran again from an older checkpoint; its first record stands in MLflow", epoch + 1)
            return
        if epoch in self.logged:
            raise PipelineError(f"epoch {epoch} was reported twice; its first metrics stand in MLflow.")
        self.logged.add(epoch)
        model = (
            {"epoch": epoch, "checkpoint": checkpoint} if checkpoint is not None and self.settings.log_model else None
        )
        reported = {k: metrics[k] for k in self.metrics if k in metrics}  # a report older than a metric lacks it
        self.record.write(metrics_record(reported, epoch, model, self.dataset_of))
        note = data_wait_note(metrics["data_wait_fraction"], self.settings.data_wait_warning)
        if note is not None:
            self.record.tag(DATA_WAIT_TAG, f"epoch {epoch + 1}: {note}")
        if "stopped_early" in metrics:  # train.early_stop ended training after this epoch
            self.stopped_early = f"after epoch {epoch + 1} by train.early_stop: {metrics['stopped_early']}"
            self.record.tag(STOPPED_TAG, self.stopped_early)
        workers = int(metrics["workers"])  # elastic: the epoch's worker group's size
        expected = expected_rows(self.rows, workers, self.drop_last) if self.rows else {}
        skipped = sum(max(0, rows - int(metrics[key])) for key, rows in expected.items())
        if skipped:
            self.record.write(metrics_record({"skipped_rows": skipped}, epoch))
            log.warning(
                "epoch %d: %d row(s) never reached training (skipped by a transform; Ray's worker logs name them)",
                epoch + 1,
                skipped,
            )
        self.last = metrics

    def reconcile(self, storage: RunStorage | None) -> list[tuple[str | None, dict]]:
        """Log each epoch and logged step whose report never reached the driver (a signal or a crash between the
        two, a worker group torn down before Ray took its report, the workers training on after the driver died),
        from the workers' records in storage (:mod:`pipeline.training.records`), whatever checkpoints Ray Train has
        deleted since: every reported epoch is in MLflow, once, resumed or not. The epochs it logged, each with its
        checkpoint's path where storage still holds it."""
        if storage is None:
            return []
        run = f"{storage.path}/{storage.name}"
        saved = {checkpoint.place(report): path for path, report in checkpoint.reports(storage.filesystem, run)}
        logged = []
        for metrics in records.read(storage):
            for global_step, loss, at in metrics.pop(records.STEPS_KEY):  # those lost on their way are logged
                self.log_step_loss(loss, global_step, at)
            finite = all(math.isfinite(v) for v in metrics.values() if isinstance(v, float))  # NaN failed the run
            within = STEP_KEY in metrics  # taken within its epoch: the epoch's metrics come later
            if metrics["epoch"] not in self.logged and finite and not within:
                epoch = metrics["epoch"] + 1
                log.warning("epoch %d: logged from the workers' record; it never reached the driver", epoch)
                path = saved.get(checkpoint.place(metrics))
                self.log_epoch(metrics, path)
                logged.append((path, metrics))
            elif finite and not within and (self.last is None or metrics["epoch"] > self.last["epoch"]):
                self.last = metrics  # logged by an earlier command: a resume with nothing left to train ends on it
        return logged

    def log_step_loss(self, loss: float, global_step: int, at: float) -> None:
        """A training batch's loss between epochs, so the UI's chart has a point per N steps, once a step: trained
        again after a restore (from a checkpoint before it), its first record stands, as an epoch's does."""
        if global_step in self.steps_logged:
            return
        self.steps_logged.add(global_step)
        self.record.write(metrics_record({STEP_LOSS_METRIC: loss}, global_step, at=at))

    def log_restore(self, epoch: int, global_step: int) -> None:
        """Count a restore from a checkpoint (a restarted worker group or a resumed run) at ``epoch``, continuing
        after ``global_step``."""
        self.rerun = {logged for logged in self.logged if logged >= epoch}
        self.restores += 1
        self.record.write(metrics_record({RESTORES_METRIC: self.restores}, epoch))
        self.record.write(metrics_record({RESTORED_STEP_METRIC: global_step}, self.restores))

    def log_step_checkpoint(self, global_step: int) -> None:
        """A checkpoint taken within an epoch, at ``global_step``: where a resume would continue (once: a stop's
        comes from the driver and may come again from Ray Train's controller)."""
        if global_step not in self.step_checkpoints:
            self.step_checkpoints.add(global_step)
            self.record.write(metrics_record({CHECKPOINT_STEP_METRIC: global_step}, global_step))
