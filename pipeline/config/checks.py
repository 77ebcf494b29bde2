"""The checks of the config itself, on the driver before Ray starts, in the order a command meets them (the data's,
the model's and the storage's come after: :mod:`pipeline.jobs.preflight` lists them all).

1. The command line, before Hydra composes (:func:`pipeline.config.command_line.check_overrides`).
2. The composed config made typed (:func:`load`, once, at the entry point): keys added with ``+key=value``
   that the schema lacks.
3. What a type cannot say (:func:`check_values`): ranges, settings that contradict each other, the task's
   metrics; then the pluggable ``_target_`` parts (:func:`check_targets`).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import typing
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from pipeline.common.errors import PipelineError
from pipeline.common.metrics import TASK_CHOICES, epoch_metrics, task_metric
from pipeline.config.schema import (
    AmpDtype,
    ExportFormat,
    FinetuneConfig,
    IngestConfig,
    OnMissing,
    PipelineConfig,
    ScalingConfig,
    SourceConfig,
    Strategy,
    TaskConfig,
    TrackingConfig,
    TrainConfig,
    TransformsConfig,
)
from pipeline.config.targets import check_target

ONNX_PACKAGES = ("onnx", "onnxscript", "onnxruntime")  # torch.onnx's exporter, and the runtime the export is checked on


def load(composed: DictConfig) -> PipelineConfig:
    """The composed config, resolved, as the schema's objects (``cfg.train.epochs``): what every stage is
    handed. Keys the schema lacks (added with ``+key=value``) fail here, naming the closest one; a config
    that is not typed yet (a run's logged one, a plain mapping) is merged onto the schema first."""
    check_keys(OmegaConf.to_container(composed, resolve=True), PipelineConfig)
    if OmegaConf.get_type(composed) is not PipelineConfig:
        composed = OmegaConf.merge(OmegaConf.structured(PipelineConfig), composed)
    return OmegaConf.to_object(composed)


def logged(config: dict, where: str) -> PipelineConfig:
    """A run's logged config (its ``config.yaml``) as the schema's objects, to rebuild its model and task."""
    try:
        return load(OmegaConf.create(config))
    except (OmegaConfBaseException, PipelineError) as err:
        raise PipelineError(f"{where}: its logged config.yaml does not fit this pipeline's schema ({err}).") from err


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise PipelineError(message)


def unwrap_optional(hint: Any) -> Any:
    """``Optional[X]`` -> ``X``; anything else unchanged."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if typing.get_origin(hint) is typing.Union and len(args) == 1 else hint


def check_keys(node: dict, schema: type, path: str = "") -> None:
    """Reject keys the schema does not declare, including ones added with Hydra's ``+key=value``
    (which bypasses the schema at composition)."""
    hints = typing.get_type_hints(schema)
    for key, value in node.items():
        if key not in hints:
            allowed = ", ".join(f.name for f in dataclasses.fields(schema))
            section, near = path.rstrip(".") or "The config", closest(key, list(hints), listed=False)
            raise PipelineError(f"{path}{key}: unknown key. {section} takes: {allowed}.{near}")
        hint = unwrap_optional(hints[key])
        if dataclasses.is_dataclass(hint) and isinstance(value, dict):
            check_keys(value, hint, f"{path}{key}.")
        elif typing.get_origin(hint) is dict:
            item_type = unwrap_optional(typing.get_args(hint)[1])
            if dataclasses.is_dataclass(item_type):
                for name, item in value.items():
                    if item is not None:
                        check_keys(item, item_type, f"{path}{key}.{name}.")


def validate(cfg: PipelineConfig) -> None:
    """Check a typed config for what the schema cannot express: its values, then its pluggable parts."""
    check_values(cfg)
    check_targets(cfg)


def check_targets(cfg: PipelineConfig) -> None:
    """Import the model's, loss's, optimizer's and scheduler's ``_target_`` and check their arguments bind
    (transforms are checked with the values, ``source.download`` where it runs). The imports are
    what costs here (the model's: torchvision), so a run does this while Ray starts."""
    check_target(cfg.model, "model")
    check_target(cfg.task.loss, "task.loss")
    check_target(cfg.optim, "optim", runtime_args=("params",))
    if cfg.scheduler is not None:
        check_target(cfg.scheduler, "scheduler", runtime_args=("optimizer", "total_steps"))


def check_task(task: TaskConfig, source: SourceConfig) -> None:
    """The task type and its metrics, the label's class count, and the feature column's form."""
    for name in task.metrics:
        _require(
            task_metric(task.type, name) is not None,
            f"task.metrics: {name!r} is not a {task.type} metric; choose from {TASK_CHOICES[task.type]}.",
        )
    _require(len(task.metrics) >= 1, "task.metrics needs at least one metric.")
    classes = source.num_classes
    _require(classes is None or classes >= 2, f"source.num_classes must be >= 2 or null, got {classes}.")
    features = source.feature_column
    _require(
        isinstance(features, str)
        or (isinstance(features, list) and features and all(isinstance(f, str) for f in features)),
        f"source.feature_column must be a column name or a non-empty list of column names, got {features!r}.",
    )


def check_values(cfg: PipelineConfig) -> None:
    """Values out of range and settings that contradict each other, section by section, and the transforms'
    ``_target_`` (cheap to import, and a bad argument there, such as ``on_error``, should fail before Ray
    starts): everything but the model's, optimizer's and scheduler's imports (:func:`check_targets`)."""
    metrics = list(epoch_metrics(cfg.task.type, cfg.task.metrics, cfg.train.other_weights()))
    _require(
        cfg.optimized_metric in metrics,
        f"optimized_metric must be one of {', '.join(metrics)}, got {cfg.optimized_metric!r}.",
    )
    check_transforms(cfg.transforms)
    check_task(cfg.task, cfg.source)
    check_source(cfg.source, cfg.ingest)
    check_training(cfg.train, metrics, cfg.finetune)
    check_tracking(cfg.tracking, cfg.train)
    check_ingest(cfg.ingest)
    check_workers(cfg.scaling, cfg.train)
    check_levers(cfg.train, cfg.scaling)
    check_batch(cfg.ingest, cfg.scaling)
    for key, s3 in (("source.s3", cfg.source.s3), ("storage.s3", cfg.storage.s3)):
        _require(s3.max_attempts >= 1, f"{key}.max_attempts must be >= 1, got {s3.max_attempts}.")
        _require(s3.connect_timeout_s > 0 and s3.request_timeout_s > 0, f"{key}: timeouts must be > 0.")
    predict = cfg.predict
    _require(
        predict.batch_size >= 1 and predict.concurrency >= 1,
        "predict.batch_size and predict.concurrency must be >= 1.",
    )


def check_transforms(transforms: TransformsConfig) -> None:
    """Each active step's function and its arguments, its CPUs, batch size and concurrency."""
    for split in ("train", "valid"):
        for name, spec in transforms.active(split).items():
            key = f"transforms.{split}.{name}"
            check_target(spec.fn, f"{key}.fn", runtime_args=("batch",), class_runtime_args=())
            _require(spec.num_cpus >= 0, f"{key}.num_cpus must be >= 0.")
            _require(spec.batch_size is None or spec.batch_size > 0, f"{key}.batch_size must be > 0 or null.")
            _require(spec.concurrency is None or spec.concurrency >= 1, f"{key}.concurrency must be >= 1 or null.")
            _require(
                spec.on_device in ("auto", True, False),
                f"{key}.on_device must be auto, true or false, got {spec.on_device!r}.",
            )


def check_source(source: SourceConfig, ingest: IngestConfig) -> None:
    """Rows per split, and what filling in missing values needs."""
    _require(source.limit is None or source.limit >= 1, f"source.limit must be >= 1 or null, got {source.limit}.")
    _require(
        source.on_missing != OnMissing.mean or ingest.standardize,
        "source.on_missing=mean fills in the training mean that ingest.standardize computes: set "
        "ingest.standardize=true, or use source.on_missing=drop.",
    )


def check_training(train: TrainConfig, metrics: list[str], finetune: FinetuneConfig) -> None:
    """The recipe: epochs, checkpoints' metric, accumulation, clipping, early stopping, failures, resuming."""
    _require(train.epochs >= 1, f"train.epochs must be >= 1, got {train.epochs}.")
    _require(
        train.checkpoint_metric in (None, *metrics),
        f"train.checkpoint_metric must be null or one of {', '.join(metrics)}, got {train.checkpoint_metric!r}.",
    )
    _require(train.accumulate >= 1, f"train.accumulate must be >= 1, got {train.accumulate}.")
    _require(
        train.grad_clip is None or train.grad_clip > 0,
        f"train.grad_clip must be > 0 or null, got {train.grad_clip}.",
    )
    stop = train.early_stop
    _require(
        stop.patience is None or stop.patience >= 1,
        f"train.early_stop.patience must be >= 1 or null, got {stop.patience}.",
    )
    _require(
        stop.metric in (None, *metrics),
        f"train.early_stop.metric must be null or one of {', '.join(metrics)}, got {stop.metric!r}.",
    )
    _require(stop.min_delta >= 0, f"train.early_stop.min_delta must be >= 0, got {stop.min_delta}.")
    _require(train.max_failures >= -1, f"train.max_failures must be >= -1, got {train.max_failures}.")
    try:
        train.step_checkpoints()
        _, auto = train.micro_rows()
    except ValueError as err:
        raise PipelineError(str(err)) from None
    _require(
        train.checkpoint_every is None or train.num_to_keep is not None,
        f"train.checkpoint_every={train.checkpoint_every!r} keeps a checkpoint every few steps or minutes and "
        "train.num_to_keep=null keeps them all, so the run's storage grows without end. Set train.num_to_keep (2, "
        "the default, keeps the latest two; with train.checkpoint_metric, the best epochs' and the latest), or "
        "train.checkpoint_every=null as well to keep every epoch's checkpoint and none within an epoch.",
    )
    _require(
        not (auto and train.accumulate > 1),
        f"train.micro_batch=auto splits each batch into as many parts as fit, and a batch that runs out of memory "
        f"runs again from its start, which a batch accumulated onto the gradients of train.accumulate="
        f"{train.accumulate}'s earlier ones cannot: set the rows per optimizer step as ingest.batch_size and "
        "train.accumulate=1 (the global batch is the same), or train.micro_batch to a number of rows.",
    )
    profile = train.profile
    _require(
        1 <= profile.epoch <= train.epochs and min(profile.wait, profile.warmup) >= 0 and profile.active >= 1,
        f"train.profile: epoch must be one of the run's (1 to train.epochs={train.epochs}), wait and warmup >= 0 and "
        f"active >= 1; got epoch={profile.epoch}, wait={profile.wait}, warmup={profile.warmup}, "
        f"active={profile.active}.",
    )
    _require(train.stop_grace_s >= 0, f"train.stop_grace_s must be >= 0, got {train.stop_grace_s}.")
    _require(
        train.ema is None or 0 < train.ema < 1,
        f"train.ema is the average's decay per optimizer step, between 0 and 1 (0.999: about the last 1,000 steps), "
        f"or null for none; got {train.ema}.",
    )
    missing = [
        name for name in ONNX_PACKAGES if ExportFormat.onnx in train.export and not importlib.util.find_spec(name)
    ]
    _require(
        not missing,
        f"train.export lists onnx, which needs the packages {', '.join(ONNX_PACKAGES)} (exporting and checking the "
        f"export); {', '.join(missing)} not installed here. Install them with pip install '.[onnx]' (or "
        "pip install onnx onnxscript onnxruntime), or leave onnx out: train.export=[torch_export].",
    )
    scale = finetune.backbone_lr_scale
    _require(scale >= 0, f"finetune.backbone_lr_scale must be >= 0, got {scale}.")


def check_tracking(tracking: TrackingConfig, train: TrainConfig) -> None:
    """What registering, evaluating and resuming need from the run's record."""
    _require(
        tracking.register_as is None or tracking.log_model,
        "tracking.register_as registers the run's logged model: set tracking.log_model=true too.",
    )
    _require(
        not train.evaluate or tracking.log_model,
        "train.evaluate evaluates the run's logged model: set tracking.log_model=true too.",
    )
    _require(
        not train.resume or tracking.run_name,
        "train.resume=true needs tracking.run_name: the name of the run to continue.",
    )


def check_ingest(ingest: IngestConfig) -> None:
    """The cache, the batch and the normalization."""
    _require(ingest.cache in (True, False, "auto"), f"ingest.cache must be auto, true or false, got {ingest.cache!r}.")
    _require(0 < ingest.cache_share <= 1, f"ingest.cache_share must be in (0, 1], got {ingest.cache_share}.")
    _require(ingest.read_task_mib > 0, f"ingest.read_task_mib must be above 0, got {ingest.read_task_mib}.")
    _require(ingest.batch_size >= 1, f"ingest.batch_size must be >= 1, got {ingest.batch_size}.")
    buffer = ingest.local_shuffle_buffer_size
    _require(
        buffer in (None, "auto") or (isinstance(buffer, int) and not isinstance(buffer, bool) and buffer >= 1),
        f"ingest.local_shuffle_buffer_size must be auto, null or a number of rows >= 1, got {buffer!r}.",
    )
    normalize = ingest.normalize
    _require(
        normalize is None or (len(normalize.mean) == len(normalize.std) and min(normalize.std) > 0),
        f"ingest.normalize needs one mean and one std > 0 per channel, got {normalize}.",
    )


def check_levers(train: TrainConfig, scaling: ScalingConfig) -> None:
    """The GPU levers' combinations (which blocks exist is checked against the model: training/parallel.py)."""
    _require(
        not (scaling.strategy == Strategy.fsdp and train.amp and train.amp_dtype == AmpDtype.float16),
        "scaling.strategy=fsdp casts to train.amp_dtype through FSDP's mixed-precision policy, which here takes "
        "bfloat16 only: float16 would need a sharded GradScaler. Set train.amp_dtype=bfloat16.",
    )
    _require(
        not (scaling.strategy == Strategy.fsdp and train.micro_rows()[1]),
        "train.micro_batch=auto retries a batch when one rank runs out of memory, but FSDP's ranks gather each "
        "block's weights together within the forward and backward, so a rank that fails mid-batch leaves the "
        "others waiting in a collective: set train.micro_batch to a number of rows with scaling.strategy=fsdp.",
    )
    _require(
        train.blocks is None or (len(train.blocks) > 0 and all(isinstance(b, str) and b for b in train.blocks)),
        f"train.blocks must be null or a non-empty list of module class names, got {train.blocks!r}.",
    )


def check_batch(ingest: IngestConfig, scaling: ScalingConfig) -> None:
    """The global batch divides evenly among the workers, at every size an elastic run may take."""
    uneven = [n for n in scaling.worker_counts if ingest.batch_size % n]
    _require(
        not uneven,
        f"ingest.batch_size ({ingest.batch_size}) is the global batch and must divide evenly "
        f"among scaling.num_workers ({scaling.num_workers}"
        + (f": not {', '.join(map(str, uneven))} of them)." if scaling.elastic else ")."),
    )


def closest(name: str, names: list[str], listed: bool = True) -> str:
    """`` Did you mean X?`` for the nearest of ``names``; else the whole list (``listed``) or nothing."""
    near = difflib.get_close_matches(name, names, n=3, cutoff=0.6)
    if near:
        return f" Did you mean {' or '.join(near)}?"
    return f" Valid: {', '.join(names)}." if listed else ""


def check_workers(scaling: ScalingConfig, train: TrainConfig) -> None:
    """``scaling.num_workers``: a count, or elastic ``[MIN, MAX]``, which needs ``train.max_failures``: Ray
    Train restarts the worker group when a node leaves, and counts that as a failure (a preempted node
    that was drained first it does not)."""
    count = scaling.num_workers
    fixed = isinstance(count, int) and not isinstance(count, bool)
    elastic = isinstance(count, list) and len(count) == 2 and all(type(n) is int for n in count)
    _require(
        (fixed and count >= 1) or (elastic and 1 <= count[0] <= count[1]),
        f"scaling.num_workers must be a count >= 1, or [MIN, MAX] with 1 <= MIN <= MAX for elastic "
        f"training, got {count!r}.",
    )
    _require(
        fixed or train.max_failures != 0,
        f"scaling.num_workers={count} is elastic: when a node leaves, Ray Train restarts the workers on fewer "
        "nodes from the latest checkpoint, and counts it as a failure. Set train.max_failures to the number "
        "of such restarts the run may take (e.g. 3, or -1 for no limit).",
    )
    local = scaling.local_mode
    _require(local in (True, False, "auto"), f"scaling.local_mode must be auto, true or false, got {local!r}.")
    group = scaling.needs_worker_group(train.max_failures)
    _require(
        local is not True or group is None,
        f"scaling.local_mode=true trains the one worker in the driver's process, but {group} needs Ray Train's "
        "worker group. Set scaling.local_mode=auto (or false), or change that setting.",
    )
