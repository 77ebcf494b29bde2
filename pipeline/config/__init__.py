"""The config: its schema (:mod:`.schema`), turned into typed objects and checked (:mod:`.checks`), and its
pluggable ``_target_`` parts (:mod:`.targets`). Imports no stage of the pipeline: every stage imports it."""

from pipeline.config.checks import check_overrides, check_targets, check_values, closest, load, logged, validate
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
    Strategy,
    TaskConfig,
    TrackingConfig,
    TrainConfig,
    TransformSpec,
    experiment_choice,
    register,
)
from pipeline.config.targets import check_target

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
    "Strategy",
    "TaskConfig",
    "TrackingConfig",
    "TrainConfig",
    "TransformSpec",
    "check_target",
    "check_overrides",
    "experiment_choice",
    "check_targets",
    "check_values",
    "closest",
    "load",
    "logged",
    "register",
    "validate",
]
