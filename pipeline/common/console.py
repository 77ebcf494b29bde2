"""What a person sees (on the driver): a progress bar per epoch and one line of metrics per epoch."""

from __future__ import annotations

import logging
import os
import sys

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from pipeline.common.metrics import is_task_metric


def quiet_libraries() -> None:
    """Keep Ray's, Ray Data's and MLflow's chatter off the console: Ray Data's console shows only what
    is critical (its notes, such as a false "the Dataset job will hang" while its own metadata tasks hold
    every CPU, are not the user's concern, and a failed dataset's traceback reaches the pipeline as an
    exception, which it reports in one paragraph), while its log file in Ray's session directory keeps all."""
    import ray.data

    logging.getLogger("ray").setLevel(logging.ERROR)
    for handler in logging.getLogger("ray.data").handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream in (sys.stdout, sys.stderr):
            handler.setLevel(logging.CRITICAL)
    logging.getLogger("mlflow").setLevel(logging.WARNING)
    # a retry of an unanswered request, per request: the spool says once when the tracking server goes and comes back
    logging.getLogger("urllib3.connectionpool").setLevel(logging.ERROR)
    ray.data.DataContext.get_current().enable_progress_bars = False
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")


def format_metrics(epoch: int, epochs: int, metrics: dict, wait_limit: float) -> str:
    """One line per epoch: losses, the task's validation metrics, throughput and data wait, and what
    to change when training waited for data more than ``wait_limit`` of the time."""
    task = "".join(f"{key} {value:.4f}  " for key, value in metrics.items() if is_task_metric(key))
    note = data_wait_note(metrics["data_wait_fraction"], wait_limit)
    return (
        f"epoch {epoch + 1}/{epochs}  train_loss {metrics['train_loss']:.4f}  val_loss {metrics['val_loss']:.4f}  "
        f"{task}train_throughput {metrics['train_throughput']:,.0f} samples/s  "
        f"data_wait {metrics['data_wait_fraction']:.0%}"
        + (f"  skipped_steps {metrics['skipped_steps']}" if metrics["skipped_steps"] else "")
        + (f"\n  {note}" if note else "")
        + (f"\n  stopping early: {metrics['stopped_early']}" if "stopped_early" in metrics else "")
    )


def data_wait_note(fraction: float, limit: float) -> str | None:
    """What to do when the training loop waited for its batches more than ``limit`` of the epoch (None if not)."""
    if fraction <= limit:
        return None
    return (
        f"data_wait {fraction:.0%} (above tracking.data_wait_warning={limit:g}): the training workers waited "
        "for data; give preprocessing more CPUs: raise scaling.data_cpus (null: every CPU that training "
        "leaves), leave it more (lower scaling.resources_per_worker.CPU, raise ray.num_cpus) or add CPU-only nodes."
    )


class Progress:
    """One progress bar per epoch (step and loss, as rank 0 sends them) and one line of metrics when
    the epoch is reported. Driven from the driver's event thread (:mod:`pipeline.training.relay`). As a
    ``with`` block, the console's log lines go above the bar, each starting on a line of its own."""

    def __init__(self, epochs: int, steps: int, wait_limit: float):
        self.epochs, self.steps, self.wait_limit, self.bar, self.epoch = epochs, steps, wait_limit, None, None
        self._logs_above = logging_redirect_tqdm()

    def __enter__(self) -> Progress:
        self._logs_above.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.close()
        self._logs_above.__exit__(*exc)

    def update(self, epoch: int, step: int, loss: float) -> None:
        if self.bar is not None and self.epoch != epoch:  # the next epoch began before this one's report came
            self.close()  # (its checkpoint was still uploading: train.checkpoint_upload=async)
        if self.bar is None:
            self.epoch = epoch
            self.bar = tqdm(
                total=self.steps,
                desc=f"epoch {epoch + 1}/{self.epochs}",
                unit="batch",
                dynamic_ncols=True,
                leave=False,
            )
        self.bar.update(step - self.bar.n)
        self.bar.set_postfix(loss=f"{loss:.4f}", refresh=False)

    def epoch_done(self, metrics: dict) -> None:
        if self.epoch == metrics["epoch"]:  # else the bar is the next epoch's, already under way
            self.close()
        tqdm.write(format_metrics(metrics["epoch"], self.epochs, metrics, self.wait_limit))

    def restored(self, epoch: int, workers: int, step: int = 0) -> None:
        self.close()  # the interrupted epoch goes on from the checkpoint's step
        where = f"epoch {epoch + 1}/{self.epochs}" + (f" after its step {step}" if step else "")
        going_on = f"continuing at {where} on {workers} worker{'s' * (workers > 1)}"
        if epoch >= self.epochs:  # the checkpoint holds the last epoch
            going_on = f"it holds all {self.epochs} epochs, nothing is left to train"
        tqdm.write(f"restored from the latest checkpoint: {going_on}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
