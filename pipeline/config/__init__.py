"""The config: its schema (:mod:`.schema`), turned into typed objects and checked (:mod:`.checks`), and its
pluggable ``_target_`` parts (:mod:`.targets`). Imports no stage of the pipeline: every stage imports it."""

from pipeline.config.checks import check_targets, check_values, closest, load, logged, unwrap_optional, validate
from pipeline.config.schema import (
    CONF_DIR,
    FinetuneConfig,
    IngestConfig,
    NormalizeConfig,
    PipelineConfig,
    PredictConfig,
    RayConfig,
    S3Config,
    ScalingConfig,
    SourceConfig,
    StorageConfig,
    TaskConfig,
    TrackingConfig,
    TrainConfig,
    TransformSpec,
    register,
)
from pipeline.config.targets import accepts, check_target, describe

__all__ = [
    "CONF_DIR",
    "FinetuneConfig",
    "IngestConfig",
    "NormalizeConfig",
    "PipelineConfig",
    "PredictConfig",
    "RayConfig",
    "S3Config",
    "ScalingConfig",
    "SourceConfig",
    "StorageConfig",
    "TaskConfig",
    "TrackingConfig",
    "TrainConfig",
    "TransformSpec",
    "accepts",
    "check_target",
    "check_targets",
    "check_values",
    "closest",
    "describe",
    "load",
    "logged",
    "register",
    "unwrap_optional",
    "validate",
]
