"""What a training run's records do in MLflow (on the driver, or later in ``python -m pipeline.sync``).

:class:`pipeline.tracking.tracker.Tracker` turns each write of a run into a record (plain JSON data) and hands it
to :class:`Delivery`, directly or through the run's :mod:`pipeline.tracking.spool`. Delivering a record twice leaves
MLflow as delivering it once: metrics carry the time they were taken (MLflow's SQL stores keep one row per
key, value, time and step), tags and the end state overwrite, an epoch's LoggedModel is looked up by the run
and epoch before one is made, and a model is registered only if the run has no version of it yet.

The records, by ``kind``:

- ``metrics``: ``metrics`` at ``step``, taken at ``timestamp``; ``model`` (the epoch's checkpoint) links
  them to its LoggedModel, ``datasets`` each to the split it was measured on
- ``tags``: ``tags`` set on the run
- ``profile``: the files ``train.profile`` wrote in the run's ``storage`` (under ``profile/``) copied to its artifacts
- ``models``: training ended; the kept checkpoints' LoggedModels get their files, the best is the run's model
- ``end``: the learning curve drawn, the run ended ``status`` (with ``error``)
"""

from __future__ import annotations

import math
import tempfile
import time

import pyarrow.fs as pafs
from mlflow import MlflowClient
from mlflow.entities import Metric, RunTag

from pipeline.common.metrics import LOSSES
from pipeline.config import PipelineConfig
from pipeline.runtime import filesystems
from pipeline.tracking import models
from pipeline.tracking.mlflow_store import end_run
from pipeline.training.profile import PROFILE_DIR


def metrics_record(
    metrics: dict, step: int, model: dict | None = None, datasets: dict | None = None, at: float | None = None
) -> dict:
    """A ``metrics`` record of ``metrics`` (name -> number) at ``step``, taken at ``at`` (seconds; None: now)."""
    values = {key: float(value) for key, value in metrics.items()}
    return {
        "kind": "metrics",
        "metrics": values,
        "step": step,
        "timestamp": int((time.time() if at is None else at) * 1000),
        "model": model,
        "datasets": datasets or {},
    }


def log_metrics(
    client: MlflowClient,
    run_id: str,
    metrics: dict,
    step: int,
    *,
    model_id: str | None = None,
    dataset_of: dict | None = None,
    timestamp: int | None = None,
) -> None:
    """``metrics`` (name -> number) in one request, at ``step``; linked to the LoggedModel ``model_id`` when
    given, and to the dataset each was measured on (``dataset_of``: metric -> dataset name and digest)."""
    at, dataset_of = timestamp or int(time.time() * 1000), dataset_of or {}
    records = [
        Metric(key, float(value), at, step, model_id, *dataset_of.get(key, (None, None)))
        for key, value in metrics.items()
    ]
    client.log_batch(run_id, metrics=records)


def epoch_history(client: MlflowClient, run_id: str, keys: tuple[str, ...]) -> list[dict]:
    """Every logged epoch's ``keys`` from the store, in epoch order (all attempts of a resumed run)."""
    by_epoch: dict[int, dict] = {}
    for key in keys:
        for metric in client.get_metric_history(run_id, key):
            by_epoch.setdefault(metric.step, {"epoch": metric.step})[key] = metric.value
    return [by_epoch[epoch] for epoch in sorted(by_epoch)]


def log_learning_curve(client: MlflowClient, run_id: str, metric: str) -> None:
    """``learning_curve.png``: train/val loss and the task's first metric against epoch, as the store holds them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    history = epoch_history(client, run_id, (*LOSSES, metric))
    if not history:
        return
    epochs = [m["epoch"] + 1 for m in history]
    fig, loss_axis = plt.subplots(figsize=(6, 4))
    loss_axis.plot(epochs, [m["train_loss"] for m in history], "o-", label="train_loss")
    loss_axis.plot(epochs, [m["val_loss"] for m in history], "s-", label="val_loss")
    loss_axis.set_xlabel("epoch")
    loss_axis.set_ylabel("loss")
    metric_axis = loss_axis.twinx()
    metric_axis.plot(epochs, [m.get(metric, math.nan) for m in history], "^-", color="tab:green", label=metric)
    metric_axis.set_ylabel(metric.removeprefix("val_"))
    handles = loss_axis.get_legend_handles_labels()[0] + metric_axis.get_legend_handles_labels()[0]
    loss_axis.legend(handles, [h.get_label() for h in handles], loc="center right")
    loss_axis.set_xticks(epochs)
    fig.tight_layout()
    client.log_figure(run_id, fig, "learning_curve.png")
    plt.close(fig)


class Delivery:
    """Writes one run's records into MLflow (see the module's docstring for each kind)."""

    def __init__(self, client: MlflowClient, experiment_id: str, run_id: str, cfg: PipelineConfig, curve_metric: str):
        self.client, self.run_id, self.cfg, self.curve_metric = client, run_id, cfg, curve_metric
        # a LoggedModel per checkpoint: made as its epoch is logged, its files saved once training ends
        self.models = models.CheckpointModels(client, experiment_id, run_id, cfg)

    def __call__(self, record: dict) -> None:
        getattr(self, f"deliver_{record['kind']}")(record)

    def deliver_metrics(self, record: dict) -> None:
        model_id = None
        if record["model"] is not None:
            model_id = self.models.start(record["model"]["epoch"], record["model"]["checkpoint"])
        datasets = {key: tuple(value) for key, value in record["datasets"].items()}
        log_metrics(
            self.client,
            self.run_id,
            record["metrics"],
            record["step"],
            model_id=model_id,
            dataset_of=datasets,
            timestamp=record["timestamp"],
        )

    def deliver_tags(self, record: dict) -> None:
        self.client.log_batch(self.run_id, tags=[RunTag(key, value) for key, value in record["tags"].items()])

    def deliver_models(self, record: dict) -> None:
        storage = filesystems.run_storage(self.cfg.storage, "", self.run_id, record["storage"])
        keep = None if record["keep"] is None else set(record["keep"])
        self.models.finish(
            keep, storage.filesystem, record["metric"], record["mode"], record["register_as"], record["alias"]
        )

    def deliver_profile(self, record: dict) -> None:
        storage = filesystems.run_storage(self.cfg.storage, "", self.run_id, record["storage"])
        source = f"{storage.path}/{storage.name}/{PROFILE_DIR}"
        with tempfile.TemporaryDirectory() as local:  # MLflow's client logs local files
            pafs.copy_files(source, local, source_filesystem=storage.filesystem)
            self.client.log_artifacts(self.run_id, local, PROFILE_DIR)

    def deliver_end(self, record: dict) -> None:
        log_learning_curve(self.client, self.run_id, self.curve_metric)
        end_run(self.client, self.run_id, record["status"], record["error"])
