"""The config: its schema (:mod:`.schema`), the checks of a composed config (:mod:`.checks`) and of its
pluggable ``_target_`` parts (:mod:`.targets`). Imports no stage of the pipeline: every stage imports it."""

from pipeline.config.checks import active_steps, check_targets, check_values, closest, unwrap_optional, validate
from pipeline.config.schema import CONF_DIR, PipelineConfig, TransformSpec, register
from pipeline.config.targets import accepts, check_target, describe

__all__ = [
    "CONF_DIR",
    "PipelineConfig",
    "TransformSpec",
    "accepts",
    "active_steps",
    "check_target",
    "check_targets",
    "check_values",
    "closest",
    "describe",
    "register",
    "unwrap_optional",
    "validate",
]
