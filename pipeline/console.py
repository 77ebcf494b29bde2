"""What a person sees (on the driver): a progress bar per epoch and one line of metrics per epoch."""

from __future__ import annotations

import logging
import os
import sys

from tqdm import tqdm


def quiet_libraries() -> None:
    """Keep Ray's, Ray Data's and MLflow's chatter off the console: Ray Data's console shows errors
    only (its notes, such as a false "the Dataset job will hang" while its own metadata tasks hold
    every CPU, are not the user's concern), while its log file in Ray's session directory keeps all."""
    import ray.data

    logging.getLogger("ray").setLevel(logging.ERROR)
    for handler in logging.getLogger("ray.data").handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream in (sys.stdout, sys.stderr):
            handler.setLevel(logging.ERROR)
    logging.getLogger("mlflow").setLevel(logging.WARNING)
    ray.data.DataContext.get_current().enable_progress_bars = False
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")


def format_metrics(epoch: int, epochs: int, metrics: dict) -> str:
    """One line per epoch: losses, the task's validation metrics, throughput and data wait."""
    task = "".join(f"{key} {value:.4f}  " for key, value in metrics.items() if is_task_metric(key))
    return (
        f"epoch {epoch + 1}/{epochs}  train_loss {metrics['train_loss']:.4f}  val_loss {metrics['val_loss']:.4f}  "
        f"{task}train_throughput {metrics['train_throughput']:,.0f} samples/s  "
        f"data_wait {metrics['data_wait_fraction']:.0%}"
    )


def is_task_metric(key: str) -> bool:
    """``val_accuracy``, ``val_mae``, ...: a validation metric of the task, not a loss or a row count."""
    return key.startswith("val_") and key not in ("val_loss", "val_rows")


class Progress:
    """One progress bar per epoch (step and loss, as rank 0 sends them) and one line of metrics when
    the epoch is reported. Driven from the driver's event thread (:mod:`pipeline.trainer`)."""

    def __init__(self, epochs: int, steps: int):
        self.epochs, self.steps, self.bar = epochs, steps, None

    def update(self, event: dict) -> None:
        if self.bar is None:
            self.bar = tqdm(
                total=self.steps,
                desc=f"epoch {event['epoch'] + 1}/{self.epochs}",
                unit="batch",
                dynamic_ncols=True,
                leave=False,
            )
        self.bar.update(event["step"] - self.bar.n)
        self.bar.set_postfix(loss=f"{event['loss']:.4f}", refresh=False)

    def epoch_done(self, metrics: dict) -> None:
        self.close()
        tqdm.write(format_metrics(metrics["epoch"], self.epochs, metrics))

    def restored(self, epoch: int) -> None:
        self.close()  # the interrupted epoch starts over
        tqdm.write(f"restored from the latest checkpoint: continuing at epoch {epoch + 1}/{self.epochs}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
