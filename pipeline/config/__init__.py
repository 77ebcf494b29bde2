"""The config: its schema (:mod:`.schema`), registered with Hydra (:mod:`.hydra_store`), turned into typed objects
and checked (:mod:`.checks`), and its pluggable ``_target_`` parts (:mod:`.targets`). Imports no stage of the
pipeline: every stage imports it."""

from pipeline.config.checks import check_targets, check_values, closest, load, logged, validate
from pipeline.config.command_line import check_overrides
from pipeline.config.hydra_store import experiment_choice, register
from pipeline.config.layout import Layout
from pipeline.config.schema import (
    CONF_DIR,
    AmpDtype,
    CheckpointUpload,
    ExportFormat,
    FinetuneConfig,
    IngestConfig,
    NormalizeConfig,
    OnMissing,
    OnNonfinite,
    PipelineConfig,
    PredictConfig,
    ProfileConfig,
    RayConfig,
    S3Config,
    ScalingConfig,
    SourceConfig,
    Stage,
    StorageConfig,
    Strategy,
    TaskConfig,
    TaskType,
    TrackingConfig,
    TrainConfig,
    TransformSpec,
)
from pipeline.config.targets import check_target

__all__ = [
    "CONF_DIR",
    "AmpDtype",
    "CheckpointUpload",
    "ExportFormat",
    "OnMissing",
    "OnNonfinite",
    "Stage",
    "TaskType",
    "FinetuneConfig",
    "IngestConfig",
    "Layout",
    "NormalizeConfig",
    "PipelineConfig",
    "PredictConfig",
    "ProfileConfig",
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
