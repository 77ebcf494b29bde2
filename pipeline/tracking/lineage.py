"""The data a run trained on (or predicted), as MLflow dataset inputs: what the UI's Dataset column shows and
what tells apart runs on different data, and the metrics' dataset links."""

from __future__ import annotations

import json
import os

import pyarrow as pa
from mlflow import MlflowClient
from mlflow.entities import Dataset, DatasetInput, InputTag
from mlflow.types import ColSpec, Schema
from mlflow.types.schema import Array, Object, Property
from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

from pipeline.common import workarounds
from pipeline.common.errors import redact

STATISTICS_ARTIFACT = "feature_statistics.json"  # with ingest.standardize: the mean and std predict applies


def log_data(client: MlflowClient, run_id: str, splits: dict, statistics: dict | None) -> None:
    """Each split as an MLflow dataset input (the UI's Dataset column): its URI, schema, rows, files and a
    digest of the file list and footers, so two runs on different data are told apart; with
    ``ingest.standardize``, the features' statistics as ``feature_statistics.json``."""
    inputs = []
    for name, split in splits.items():
        schema = Schema([ColSpec(mlflow_type(field.type), field.name) for field in split.schema])
        dataset = Dataset(
            name=dataset_name(split),
            digest=split.digest,
            source_type="s3" if split.uri.startswith("s3://") else "local",
            source=json.dumps({"uri": redact(split.uri)}),
            schema=json.dumps({"mlflow_colspec": schema.to_dict()}),
            profile=json.dumps({"num_rows": split.rows, "num_files": len(split.files)}),
        )
        context = InputTag(MLFLOW_DATASET_CONTEXT, {"train": "training", "valid": "validation"}.get(name, name))
        inputs.append(DatasetInput(dataset, [context]))
    workarounds.log_inputs(client, run_id, inputs)  # MLflow 3.17's race between runs logging one dataset
    if statistics is not None:
        client.log_dict(run_id, statistics, STATISTICS_ARTIFACT)


def dataset_name(split) -> str:
    """A split's dataset name in MLflow: its directory and its parent's (``cifar10/train``)."""
    uri = split.uri.rstrip("/")
    return f"{os.path.basename(os.path.dirname(uri))}/{os.path.basename(uri)}"


def mlflow_type(kind: pa.DataType):
    """The MLflow schema type of an Arrow type (lists and structs included)."""
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
        return Array(mlflow_type(kind.value_type))
    if pa.types.is_struct(kind):
        return Object([Property(field.name, mlflow_type(field.type)) for field in kind])
    for test, name in (
        (pa.types.is_boolean, "boolean"),
        (pa.types.is_int32, "integer"),
        (pa.types.is_integer, "long"),
        (pa.types.is_float32, "float"),
        (pa.types.is_floating, "double"),
        (lambda k: pa.types.is_binary(k) or pa.types.is_large_binary(k), "binary"),
        (pa.types.is_timestamp, "datetime"),
    ):
        if test(kind):
            return name
    return "string"
