"""A run's config in MLflow: logged once, secrets removed, as searchable params and as the whole
``config.yaml`` that prediction, evaluation and fine-tuning read back typed."""

from __future__ import annotations

import dataclasses
import enum
import tempfile

import yaml
from mlflow import MlflowClient
from mlflow.entities import Param

from pipeline.common.errors import redact
from pipeline.config import PipelineConfig, logged

MAX_PARAMS_PER_BATCH = 100  # MLflow's limit for one log_batch call


def flatten(node: object, prefix: str = "") -> dict[str, str]:
    """``{"model": {"hidden_dim": 384}}`` -> ``{"model.hidden_dim": "384"}``; lists stay whole values."""
    if not isinstance(node, dict):
        return {prefix: str(node)}
    flat: dict[str, str] = {}
    for key, value in node.items():
        flat.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def plain_value(value: object) -> object:
    """A choice setting (an Enum, or a list of them) as its value, so the config dumps as plain YAML."""
    if isinstance(value, list):
        return [plain_value(item) for item in value]
    return value.value if isinstance(value, enum.Enum) else value


def without_secrets(cfg: PipelineConfig) -> dict:
    """``cfg`` as plain data, with the values of ``ray.runtime_env.env_vars`` (where credentials for the
    cluster's workers go) replaced by ``***``."""
    plain = dataclasses.asdict(cfg, dict_factory=lambda items: {k: plain_value(v) for k, v in items})
    env_vars = cfg.ray.runtime_env.get("env_vars")
    if env_vars:
        plain["ray"]["runtime_env"]["env_vars"] = dict.fromkeys(env_vars, "***")
    return plain


def log_config(client: MlflowClient, run_id: str, cfg: PipelineConfig) -> None:
    """The resolved config, secrets removed, twice: flattened as params (searchable) and whole as
    ``config.yaml`` (what :func:`logged_config` reads back)."""
    cfg = without_secrets(cfg)
    params = [Param(key, redact(value)) for key, value in flatten(cfg).items()]
    for start in range(0, len(params), MAX_PARAMS_PER_BATCH):
        client.log_batch(run_id, params=params[start : start + MAX_PARAMS_PER_BATCH])
    client.log_text(run_id, redact(yaml.safe_dump(cfg, sort_keys=False)), "config.yaml")


def logged_config(client: MlflowClient, run_id: str) -> PipelineConfig:
    """The config a run logged (``config.yaml``), typed."""
    with tempfile.TemporaryDirectory() as tmp, open(client.download_artifacts(run_id, "config.yaml", tmp)) as file:
        return logged(yaml.safe_load(file), f"run {run_id}")
