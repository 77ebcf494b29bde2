"""Tracking stage: one MLflow run per job, written only by the driver.

Everything goes through ``MlflowClient`` with an explicit run id, so no global "active run" state
leaks between the jobs of a sweep or into worker processes.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import yaml
from mlflow import MlflowClient
from mlflow.entities import Metric, Param, RunStatus
from mlflow.utils.mlflow_tags import MLFLOW_GIT_COMMIT, MLFLOW_PARENT_RUN_ID

from pipeline.config import EPOCH_METRICS, PipelineError

MAX_PARAMS_PER_BATCH = 100  # MLflow's limit for one log_batch call
MAX_TAG_LENGTH = 5000  # MLflow rejects longer tag values
SWEEP_DIR_TAG = "pipeline.sweep_dir"
OVERRIDES_TAG = "pipeline.overrides"
ERROR_TAG = "pipeline.error"
STORAGE_TAG = "pipeline.storage"  # where Ray Train keeps this run's checkpoints
RESTORES_METRIC = "restores"  # count of restores from a checkpoint; step = the epoch training continued at


_URI_PASSWORD = re.compile(r"(://[^/@\s:]+):[^/@\s]+@")


def redact(text: str) -> str:
    """``https://user:token@host`` -> ``https://user:***@host``: secrets in URIs stay out of MLflow and logs."""
    return _URI_PASSWORD.sub(r"\1:***@", text)


def resolve_uri(uri: str | None, outputs: str) -> str:
    """``tracking.uri`` (MLFLOW_TRACKING_URI feeds it), else an SQLite store in the outputs directory."""
    return uri or f"sqlite:///{Path(outputs).resolve() / 'mlflow.db'}"


def connect(uri: str | None, outputs: str) -> tuple[MlflowClient, str]:
    """A client for the store :func:`resolve_uri` names (creating the outputs directory it lives in),
    with the store opened: a new SQLite store creates its tables here, the first time only."""
    resolved = resolve_uri(uri, outputs)
    if uri is None:
        os.makedirs(outputs, exist_ok=True)
    client = MlflowClient(tracking_uri=resolved)
    client.search_experiments(max_results=1)
    return client, resolved


def flatten(node: object, prefix: str = "") -> dict[str, str]:
    """``{"model": {"hidden_dim": 384}}`` -> ``{"model.hidden_dim": "384"}``; lists stay whole values."""
    if not isinstance(node, dict):
        return {prefix: str(node)}
    flat: dict[str, str] = {}
    for key, value in node.items():
        flat.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def experiment_id(client: MlflowClient, uri: str, name: str, outputs: str) -> str:
    """The experiment's id, created on first use; with the embedded SQLite store its artifacts go
    beside the store in ``<outputs>/mlartifacts``."""
    found = client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    artifacts = (Path(outputs).resolve() / "mlartifacts").as_uri() if uri.startswith("sqlite:") else None
    return client.create_experiment(name, artifact_location=artifacts)


def sweep_parent(client: MlflowClient, experiment: str, sweep_dir: str) -> str:
    """The parent run of a Hydra multirun, found by its sweep directory or created by its first job."""
    found = client.search_runs([experiment], filter_string=f"tags.`{SWEEP_DIR_TAG}` = '{sweep_dir}'", max_results=1)
    if found:
        return found[0].info.run_id
    name = "sweep " + "/".join(Path(sweep_dir).parts[-2:])
    return client.create_run(experiment, run_name=name, tags={SWEEP_DIR_TAG: sweep_dir}).info.run_id


def git_commit(path: str) -> str | None:
    """The commit of the code at ``path`` (with ``-dirty`` for uncommitted changes), if it is a checkout."""
    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty", "--abbrev=40", "--match=NeVeR"],
            cwd=path,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


def start_run(
    client: MlflowClient, experiment: str, run_name: str | None, parent: str | None, overrides: list[str], code_dir: str
) -> str:
    """Create the job's run (RUNNING), nested under ``parent`` in a sweep, tagged with the Hydra
    overrides and the code's git commit."""
    tags = {OVERRIDES_TAG: redact(" ".join(overrides))[:MAX_TAG_LENGTH]}
    if parent is not None:
        tags[MLFLOW_PARENT_RUN_ID] = parent
    commit = git_commit(code_dir)
    if commit is not None:
        tags[MLFLOW_GIT_COMMIT] = commit
    return client.create_run(experiment, run_name=run_name, tags=tags).info.run_id


def reopen_run(client: MlflowClient, experiment: str, run_name: str) -> tuple[str, str]:
    """The newest unfinished run named ``run_name``, set RUNNING again, and its checkpoint location."""
    found = client.search_runs(
        [experiment],
        filter_string=f"attributes.run_name = '{run_name}'",
        order_by=["attributes.start_time DESC"],
        max_results=1,
    )
    if not found:
        raise PipelineError(
            f"train.resume=true: no run named {run_name!r} in this experiment to resume "
            "(tracking.run_name). Without train.resume a run always starts fresh."
        )
    run = found[0]
    if run.info.status == "FINISHED":
        raise PipelineError(
            f"train.resume=true: run {run_name!r} ({run.info.run_id}) already finished; start a new run instead."
        )
    if STORAGE_TAG not in run.data.tags:
        raise PipelineError(
            f"train.resume=true: run {run_name!r} ({run.info.run_id}) never reached training, "
            "so it has no checkpoint to resume from."
        )
    client.update_run(run.info.run_id, status="RUNNING")
    if ERROR_TAG in run.data.tags:  # the failure that stopped it is in the past now
        client.delete_tag(run.info.run_id, ERROR_TAG)
    return run.info.run_id, run.data.tags[STORAGE_TAG]


def without_secrets(cfg: dict) -> dict:
    """``cfg`` with the values of ``ray.runtime_env.env_vars`` (where credentials for the cluster's
    workers go) replaced by ``***``."""
    runtime_env = dict(cfg["ray"]["runtime_env"])
    if runtime_env.get("env_vars"):
        runtime_env["env_vars"] = {key: "***" for key in runtime_env["env_vars"]}
    return {**cfg, "ray": {**cfg["ray"], "runtime_env": runtime_env}}


def log_config(client: MlflowClient, run_id: str, cfg: dict) -> None:
    """The resolved config, secrets removed, twice: flattened as params (searchable) and whole as
    ``config.yaml`` (what :func:`logged_config` reads back)."""
    cfg = without_secrets(cfg)
    params = [Param(key, redact(value)) for key, value in flatten(cfg).items()]
    for start in range(0, len(params), MAX_PARAMS_PER_BATCH):
        client.log_batch(run_id, params=params[start : start + MAX_PARAMS_PER_BATCH])
    client.log_text(run_id, redact(yaml.safe_dump(cfg, sort_keys=False)), "config.yaml")


def logged_config(client: MlflowClient, run_id: str) -> dict:
    """The config a run logged (``config.yaml``)."""
    with tempfile.TemporaryDirectory() as tmp, open(client.download_artifacts(run_id, "config.yaml", tmp)) as file:
        return yaml.safe_load(file)


def log_metrics(client: MlflowClient, run_id: str, metrics: dict, step: int) -> None:
    """``metrics`` (name -> number) in one request, at ``step``."""
    now = int(time.time() * 1000)
    client.log_batch(run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()])


def log_epoch(client: MlflowClient, run_id: str, metrics: dict, epoch: int) -> None:
    """The per-epoch metrics, with step = epoch."""
    log_metrics(client, run_id, {k: metrics[k] for k in EPOCH_METRICS}, epoch)


def logged_epochs(client: MlflowClient, run_id: str) -> set[int]:
    """Epochs whose metrics the run already holds (a resumed run continues after them)."""
    return {m.step for m in client.get_metric_history(run_id, EPOCH_METRICS[0])}


def log_restore(client: MlflowClient, run_id: str, epoch: int) -> None:
    """Count a restore from a checkpoint (a restarted worker group or a resumed run) at ``epoch``."""
    count = len(client.get_metric_history(run_id, RESTORES_METRIC)) + 1
    client.log_metric(run_id, RESTORES_METRIC, count, step=epoch)


def epoch_history(client: MlflowClient, run_id: str) -> list[dict]:
    """Every logged epoch's metrics from the store, in epoch order (all attempts of a resumed run)."""
    by_epoch: dict[int, dict] = {}
    for key in EPOCH_METRICS:
        for metric in client.get_metric_history(run_id, key):
            by_epoch.setdefault(metric.step, {"epoch": metric.step})[key] = metric.value
    return [by_epoch[epoch] for epoch in sorted(by_epoch)]


def log_model(client: MlflowClient, run_id: str, checkpoint_file: str) -> None:
    """The final weights as ``model/state_dict.pt``, loadable with ``torch.load(weights_only=True)``."""
    state = torch.load(checkpoint_file, map_location="cpu", weights_only=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "state_dict.pt")
        torch.save(state["model"], path)
        client.log_artifact(run_id, path, "model")


def log_learning_curve(client: MlflowClient, run_id: str) -> None:
    """``learning_curve.png``: train/val loss and val accuracy against epoch, as the store holds them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    history = epoch_history(client, run_id)
    epochs = [m["epoch"] + 1 for m in history]
    fig, loss_axis = plt.subplots(figsize=(6, 4))
    loss_axis.plot(epochs, [m["train_loss"] for m in history], "o-", label="train_loss")
    loss_axis.plot(epochs, [m["val_loss"] for m in history], "s-", label="val_loss")
    loss_axis.set_xlabel("epoch")
    loss_axis.set_ylabel("loss")
    accuracy_axis = loss_axis.twinx()
    accuracy_axis.plot(epochs, [m["val_accuracy"] for m in history], "^-", color="tab:green", label="val_accuracy")
    accuracy_axis.set_ylabel("accuracy")
    handles = loss_axis.get_legend_handles_labels()[0] + accuracy_axis.get_legend_handles_labels()[0]
    loss_axis.legend(handles, [h.get_label() for h in handles], loc="center right")
    loss_axis.set_xticks(epochs)
    fig.tight_layout()
    client.log_figure(run_id, fig, "learning_curve.png")
    plt.close(fig)


@contextmanager
def recorded(client: MlflowClient, run_id: str) -> Iterator[None]:
    """End the run when the block does: FINISHED, KILLED on Ctrl-C or SIGTERM (SystemExit), FAILED on
    any other error (its message kept as a tag)."""
    try:
        yield
    except (KeyboardInterrupt, SystemExit) as err:
        end_run(client, run_id, "KILLED", err)
        raise
    except BaseException as err:
        end_run(client, run_id, "FAILED", err)
        raise
    end_run(client, run_id, "FINISHED")


def end_run(client: MlflowClient, run_id: str, status: str, error: BaseException | None = None) -> None:
    """Close the run as FINISHED, FAILED or KILLED; a failure keeps its message as a tag."""
    if error is not None:
        client.set_tag(run_id, ERROR_TAG, f"{type(error).__name__}: {error}"[:MAX_TAG_LENGTH])
    client.set_terminated(run_id, status=RunStatus.to_string(getattr(RunStatus, status)))
