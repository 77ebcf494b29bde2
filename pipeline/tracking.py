"""Tracking stage: one MLflow run per job, written only by the driver.

Everything goes through ``MlflowClient`` with an explicit run id, so no global "active run" state
leaks between the jobs of a sweep or into worker processes.
"""
from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import torch
from mlflow import MlflowClient
from mlflow.entities import Metric, Param, RunStatus

EPOCH_METRICS = ("train_loss", "val_loss", "val_accuracy", "train_throughput")
MAX_PARAMS_PER_BATCH = 100  # MLflow's limit for one log_batch call


def resolve_uri(uri: str | None, outputs: str) -> str:
    """``tracking.uri`` (MLFLOW_TRACKING_URI feeds it), else an SQLite store in the outputs directory."""
    return uri or f"sqlite:///{Path(outputs).resolve() / 'mlflow.db'}"


def flatten(node: object, prefix: str = "") -> dict[str, str]:
    """``{"model": {"hidden_dim": 384}}`` -> ``{"model.hidden_dim": "384"}``; lists stay whole values."""
    if not isinstance(node, dict):
        return {prefix: str(node)}
    flat: dict[str, str] = {}
    for key, value in node.items():
        flat.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def start_run(uri: str, experiment: str, run_name: str | None, outputs: str) -> tuple[MlflowClient, str]:
    """Create the run (RUNNING) in ``experiment``, creating the experiment on first use.

    With the embedded SQLite store, artifacts go beside it in ``<outputs>/mlartifacts``.
    """
    os.makedirs(outputs, exist_ok=True)
    client = MlflowClient(tracking_uri=uri)
    found = client.get_experiment_by_name(experiment)
    if found is not None:
        experiment_id = found.experiment_id
    else:
        artifacts = (Path(outputs).resolve() / "mlartifacts").as_uri() if uri.startswith("sqlite:") else None
        experiment_id = client.create_experiment(experiment, artifact_location=artifacts)
    run = client.create_run(experiment_id, run_name=run_name)
    return client, run.info.run_id


def log_config(client: MlflowClient, run_id: str, cfg: dict, config_yaml: str) -> None:
    """The resolved config twice: flattened as params (searchable) and whole as ``config.yaml``."""
    params = [Param(key, value) for key, value in flatten(cfg).items()]
    for start in range(0, len(params), MAX_PARAMS_PER_BATCH):
        client.log_batch(run_id, params=params[start : start + MAX_PARAMS_PER_BATCH])
    client.log_text(run_id, config_yaml, "config.yaml")


def log_epoch(client: MlflowClient, run_id: str, metrics: dict, epoch: int) -> None:
    """The per-epoch metrics, with step = epoch."""
    now = int(time.time() * 1000)
    client.log_batch(run_id, metrics=[Metric(k, float(metrics[k]), now, epoch) for k in EPOCH_METRICS])


def log_model(client: MlflowClient, run_id: str, checkpoint_file: str) -> None:
    """The final weights as ``model/state_dict.pt``, loadable with ``torch.load(weights_only=True)``."""
    state = torch.load(checkpoint_file, map_location="cpu", weights_only=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "state_dict.pt")
        torch.save(state["model"], path)
        client.log_artifact(run_id, path, "model")


def end_run(client: MlflowClient, run_id: str, status: str) -> None:
    """Close the run as FINISHED, FAILED or KILLED."""
    client.set_terminated(run_id, status=RunStatus.to_string(getattr(RunStatus, status)))
