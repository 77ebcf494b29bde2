"""Config schema and checks: the typed shape of ``conf/`` and every check that runs before Ray starts.

The dataclasses are registered as Hydra's ``schema`` config, so a wrong type or an unknown key fails
at composition. They are the one place every default is set, with its comment; ``conf/`` holds only
what a choice (a source, a model, GPU scaling, an experiment) changes. Pluggable parts (``_target_``
nodes) are free-form there; :func:`validate` imports each target and binds its keyword arguments, so
a misspelt argument fails here too, not on a worker.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from pipeline.metrics import TASK_CHOICES, epoch_metrics, task_metric

CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")


class PipelineError(Exception):
    """A problem with the user's config or data, reported as one paragraph without a traceback."""


@dataclass
class S3Config:
    """How to reach S3 or an S3-compatible store. There are no credential fields on purpose: the AWS
    SDK reads them from the environment, AWS_PROFILE or an instance role (pipeline/filesystems.py)."""

    region: Optional[str] = None  # null: the AWS SDK's default (AWS_DEFAULT_REGION, profile, us-east-1)
    endpoint_url: Optional[str] = "${oc.env:AWS_ENDPOINT_URL,null}"  # MinIO, Ceph, R2: http(s)://host:port
    anonymous: bool = False  # public buckets; s3://anonymous@bucket/... does the same per path
    connect_timeout_s: float = 5.0  # an unreachable endpoint fails after about this x max_attempts
    request_timeout_s: float = 30.0
    max_attempts: int = 3


@dataclass
class SourceConfig:
    root: str = "${oc.env:PIPELINE_DATA_DIR,data}"  # data root; relative paths resolve against the cwd
    train: str = MISSING  # parquet directory, file or glob
    valid: str = MISSING
    test: Optional[str] = None  # held-out labelled rows, never trained or validated on: what evaluation scores
    # the model's input: one column (encoded images, or a list/array of numbers per row), or a list of
    # numeric columns, stacked into one float32 vector per row (tables)
    feature_column: Any = "image"
    label_column: str = "label"
    num_classes: Optional[int] = None  # classification: labels must be 0..num_classes-1 (checked before training)
    # classification by name ("benign", "malignant"): the class names, index order; when the label column
    # holds strings, found (sorted) in the training split and num_classes set to their count
    classes: Optional[list[str]] = None
    # a table's missing (null), NaN or infinite feature values: raise (fail naming file, column and row),
    # drop (the row, counted as skipped_rows) or mean (the training split's mean; needs ingest.standardize)
    on_missing: str = "raise"
    limit: Optional[int] = None  # cap on rows per split
    download: Optional[Any] = None  # _target_ callable(root) that fetches the data when it is missing
    reader_v2: bool = False  # Ray Data's V2 parquet reader (starts footer-reader actors: slower to start)
    task_per_file: bool = True  # one read task per file, which also runs the transforms (see TransformSpec)
    s3: S3Config = field(default_factory=S3Config)  # used when a split is an s3:// URI


@dataclass
class TransformSpec:
    fn: Any = MISSING  # _target_ node: a function (run as Ray tasks) or a class (run as an actor pool)
    num_cpus: float = 1.0  # CPUs per preprocessing task/actor, separate from the training workers
    batch_size: Optional[int] = None  # rows per call; null: whole blocks, so Ray Data fuses the read and
    # every step into one task (a file read, decoded and augmented in one go, nothing copied between steps)
    concurrency: Optional[int] = None  # tasks at once (functions) or actor pool size (classes); null: Ray's
    # run once and kept in Ray's object store (ingest.cache), or every epoch; null: every epoch when the
    # function takes an `epoch` (seeded augmentation), else once. Steps after an every-epoch one run every epoch.
    cache: Optional[bool] = None
    resources: dict[str, float] = field(default_factory=dict)  # custom resources per task, e.g. {cpu_node: 1}:
    label_selector: dict[str, str] = field(default_factory=dict)  # ...or node labels: where the step may run


@dataclass
class TransformsConfig:
    train: dict[str, Optional[TransformSpec]] = field(default_factory=dict)  # null drops a step
    valid: dict[str, Optional[TransformSpec]] = field(default_factory=dict)


@dataclass
class EarlyStopConfig:
    """Stop training once ``metric`` has gone ``patience`` epochs without improving by more than ``min_delta``."""

    patience: Optional[int] = None  # epochs without improvement before stopping; null: never stop early
    metric: Optional[str] = None  # any metric an epoch reports (val_loss, val_accuracy, ...); null: optimized_metric
    min_delta: float = 0.0  # smaller improvements do not count


@dataclass
class TrainConfig:
    epochs: int = 1
    seed: int = 0
    amp: bool = False  # autocast on GPU workers; ignored on CPU
    amp_dtype: str = "bfloat16"  # bfloat16 or float16 (float16 adds a GradScaler)
    num_to_keep: Optional[int] = None  # best checkpoints kept (the latest is always kept too); null keeps all
    checkpoint_metric: Optional[str] = None  # what "best" means, e.g. val_accuracy; null: the most recent
    evaluate: bool = False  # then stage=evaluate with the run's best model, in a run nested under it
    checkpoint_mode: Optional[str] = None  # max or min of checkpoint_metric; null: min for losses and errors
    max_failures: int = 0  # worker-group restarts from the latest checkpoint before the run fails; -1: no limit
    resume: bool = False  # continue the run named tracking.run_name from its latest checkpoint
    grad_clip: Optional[float] = None  # clip the gradients' global L2 norm to this before each step; null: no clip
    accumulate: int = 1  # batches per optimizer step (gradient accumulation: DDP all-reduces only on the last)
    # a loss or gradient that is NaN or inf: raise (the run fails, naming the epoch and step) or skip (that
    # optimizer step is not taken; counted per epoch as skipped_steps)
    on_nonfinite: str = "raise"
    early_stop: EarlyStopConfig = field(default_factory=EarlyStopConfig)


@dataclass
class FinetuneConfig:
    """Where training starts and what of the model trains (README, "Fine-tuning"); weights are read on the
    driver before Ray starts, as tensors only."""

    # null: random weights. Else a torchvision weight name for model._target_ (IMAGENET1K_V1, DEFAULT), a
    # state dict or checkpoint.pt file, or an MLflow model: runs:/RUN_ID/model, models:/NAME@ALIAS, models:/NAME/1
    weights: Optional[str] = None
    # parameter-name patterns (fnmatch) of the head, which starts fresh where its shape differs from the
    # weights' (another class count); empty: the model's last layer with parameters (README names it)
    head: list[str] = field(default_factory=list)
    freeze: list[str] = field(default_factory=list)  # parameter-name patterns kept as loaded, e.g. "conv1.*"
    # the rest of the model (the backbone) learns at this fraction of the head's rate (optim.lr, the schedule's)
    backbone_lr_scale: float = 1.0


@dataclass
class ScalingConfig:
    num_workers: int = 2
    use_gpu: bool = False
    resources_per_worker: dict[str, float] = field(default_factory=lambda: {"CPU": 0.5})
    label_selector: dict[str, str] = field(default_factory=dict)  # node labels training workers need
    data_cpus: Optional[float] = None  # CPU budget for Ray Data preprocessing; null: what training leaves
    torch_threads: Optional[int] = None  # intra-op threads per worker; null: Ray's default


@dataclass
class NormalizeConfig:
    mean: list[float] = field(default_factory=lambda: [0.5, 0.5, 0.5])
    std: list[float] = field(default_factory=lambda: [0.5, 0.5, 0.5])


@dataclass
class IngestConfig:
    batch_size: int = 128  # global: each of N workers gets batch_size / N rows per step
    prefetch_batches: int = 2
    local_shuffle_buffer_size: Optional[int] = None  # rows; null: no per-worker shuffle
    drop_last: bool = False
    preserve_order: bool = False  # deterministic block order (reproducible runs) at some throughput cost
    # uint8 pixels travel as they are (a quarter of float32's bytes) and become (x/255 - mean) / std on the
    # training device; null: features reach the model as they are
    normalize: Optional[NormalizeConfig] = field(default_factory=NormalizeConfig)  # (uint8 features only)
    # each row in a new seeded order every epoch, whatever the file layout (class-sorted files included);
    # costs some ingest speed (README, Performance)
    shuffle: bool = True
    # run each split's deterministic steps (decoding, resizing: see TransformSpec.cache) once and keep their
    # output in Ray's object store, so later epochs run only the random steps: auto (on when the estimate,
    # from the first rows, fits cache_share of the store), true (fail before training when it does not), false
    cache: Any = "auto"
    cache_share: float = 0.5  # of the object store the cache may take; Ray Data streams through the rest
    # scale float features by the training split's per-feature mean and std (computed before training,
    # saved with the run and applied by predict too): for tables of numbers
    standardize: bool = False


@dataclass
class TaskConfig:
    """What the model learns, which sets the loss, the metrics and what a prediction is (conf/task/)."""

    type: str = "classification"  # classification (integer labels) or regression (numeric labels)
    loss: Any = field(default_factory=lambda: {"_target_": "torch.nn.CrossEntropyLoss"})  # any torch loss module
    # reported as val_<name>: classification accuracy, topK_accuracy (top5_accuracy); regression mae, mse, rmse
    metrics: list[str] = field(default_factory=lambda: ["accuracy"])


@dataclass
class TrackingConfig:
    uri: Optional[str] = "${oc.env:MLFLOW_TRACKING_URI,null}"  # null: sqlite in paths.outputs
    experiment_name: Optional[str] = None  # null: the +experiment=NAME chosen, else "default"
    run_name: Optional[str] = None
    # each kept checkpoint as a LoggedModel (Logged models tab), and the best one's weights (by
    # train.checkpoint_metric; else the last) as the run's model/state_dict.pt
    log_model: bool = True
    # register the best LoggedModel as a version of this registered model, and move register_alias to it (a
    # sweep's: to its best job's version); load it back as models:/NAME@ALIAS
    register_as: Optional[str] = None
    register_alias: str = "champion"
    log_every_n_steps: int = 50  # rank 0's batch loss as train_loss_step (MLflow step: global step); 0: off
    system_metrics_s: Optional[float] = 10.0  # MLflow's system metrics (CPU, memory, GPU) every N s; null: off
    data_wait_warning: float = 0.2  # an epoch whose data_wait_fraction is above this says so (console, MLflow)


@dataclass
class RayConfig:
    address: Optional[str] = "${oc.env:RAY_ADDRESS,null}"  # null: a local runtime; auto, HOST:PORT, ray://...
    # logical CPUs of a local runtime; null: the machine's cores plus the training workers' CPUs, so
    # preprocessing may use the cores a waiting worker leaves idle (data_wait_fraction judges: README)
    num_cpus: Optional[int] = None
    object_store_memory: Optional[int] = None  # bytes, a local runtime's; null: Ray's default (30% of RAM)
    py_modules: list[str] = field(default_factory=lambda: ["pipeline", "transforms"])  # shipped to a cluster
    runtime_env: dict[str, Any] = field(default_factory=dict)  # Ray's runtime_env for the job (pip, env_vars...)


@dataclass
class PredictConfig:
    # whose model predicts: a run's name or id, or models:/NAME@ALIAS (runs:/ID/model); null: the newest finished run
    run: Optional[str] = None
    checkpoint: Optional[str] = None  # a checkpoint.pt (or its directory) instead of the run's logged model
    source: Optional[str] = (
        None  # parquet to predict over: a directory, file, glob or s3:// URI; null: source.test, else source.valid
    )
    output: Optional[str] = None  # predictions directory, local or s3://; null: <run dir>/predictions
    batch_size: int = 1024
    concurrency: int = 1  # model replicas (actors), each loading the model once
    num_cpus: float = 1.0
    num_gpus: Optional[float] = None  # per replica; null: 1 when scaling.use_gpu, else 0
    resources: dict[str, float] = field(default_factory=dict)
    label_selector: dict[str, str] = field(default_factory=dict)


@dataclass
class PathsConfig:
    outputs: str = "outputs"  # run directories and the embedded MLflow store


@dataclass
class StorageConfig:
    """Ray Train's run storage: checkpoints and run state, which every node must reach."""

    path: Optional[str] = None  # null: the job's output directory; s3://bucket/prefix or a shared path
    s3: S3Config = field(default_factory=S3Config)  # used when path is an s3:// URI


@dataclass
class PipelineConfig:
    source: SourceConfig = field(default_factory=SourceConfig)
    transforms: TransformsConfig = field(default_factory=TransformsConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    model: Any = MISSING
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    optim: Any = MISSING
    scheduler: Optional[Any] = None
    train: TrainConfig = field(default_factory=TrainConfig)
    scaling: ScalingConfig = field(default_factory=ScalingConfig)
    ingest: IngestConfig = field(default_factory=IngestConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    paths: PathsConfig = field(default_factory=PathsConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    # train; predict with a trained run's model (the predict section); evaluate: predict over labelled rows,
    # plus a confusion matrix and per-class precision, recall and F1 (a residual plot for regression)
    stage: str = "train"
    predict: PredictConfig = field(default_factory=PredictConfig)
    optimized_metric: str = "val_${task.metrics[0]}"  # what the entry point returns to a sweeper (Optuna)


def active_steps(steps: dict[str, dict | None]) -> dict[str, dict]:
    """The transform steps of one split, without those set to null (dropped by an overlay)."""
    return {name: spec for name, spec in steps.items() if spec is not None}


def register() -> None:
    """Make the schema available to ``conf/config.yaml`` as its first default, and the pipeline's sweeper
    and launcher (pipeline/plugins/hydra_plugins/pipeline_launcher.py) as ``hydra/{sweeper,launcher}=pipeline``."""
    store, plugins = ConfigStore.instance(), "hydra_plugins.pipeline_launcher"
    store.store(name="schema", node=PipelineConfig)
    store.store(group="hydra/launcher", name="pipeline", node={"_target_": f"{plugins}.PipelineLauncher"})
    sweeper = {"_target_": f"{plugins}.PipelineSweeper", "max_batch_size": None, "params": None}
    store.store(group="hydra/sweeper", name="pipeline", node=sweeper)
    tune = {  # conf/hparams_search/tune.yaml sets them, with comments
        "_target_": f"{plugins}.TuneSweeper",
        "_recursive_": False,  # search_alg and scheduler stay configs: tuning.py instantiates them
        "num_samples": 1,
        "max_concurrent_trials": None,
        "seed": None,
        "search_alg": None,
        "scheduler": None,
        "params": None,
    }
    store.store(group="hydra/sweeper", name="tune", node=tune)


def compose(overrides: list[str] = ()) -> dict:
    """The resolved config as the entry point sees it (a plain dict), outside ``@hydra.main``:
    for tests and benchmarks, which build a job's parts themselves."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf

    register()
    from pipeline.source import with_classes

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = hydra_compose(config_name="config", overrides=list(overrides))
    with_classes(cfg)
    return OmegaConf.to_container(cfg, resolve=True)


def _import(target: str, key: str) -> Any:
    module_name, _, attr = target.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as err:
        raise PipelineError(f"{key}._target_: cannot import {target!r} ({err}).") from err


def check_target(
    node: Any, key: str, runtime_args: tuple[str, ...] = (), class_runtime_args: tuple[str, ...] | None = None
) -> None:
    """Import ``node._target_`` and check its keyword arguments bind to the callable's signature.

    ``runtime_args`` are the arguments the pipeline itself passes (``params`` for an optimizer);
    ``class_runtime_args`` replace them when the target is a class (a transform class is built
    from its params alone; its instances take the batch).
    """
    if not isinstance(node, dict) or "_target_" not in node:
        raise PipelineError(f"{key}: expected a mapping with a _target_ key, got {node!r}.")
    target = _import(node["_target_"], key)
    if class_runtime_args is not None and inspect.isclass(target):
        runtime_args = class_runtime_args
    kwargs = {k: v for k, v in node.items() if not (k.startswith("_") and k.endswith("_"))}
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return  # builtins without a signature: nothing to check
    try:
        signature.bind_partial(**{name: None for name in runtime_args}, **kwargs)
    except TypeError as err:
        params = ", ".join(p for p in signature.parameters if p not in runtime_args)
        raise PipelineError(
            f"{key}: {node['_target_']} does not accept these arguments ({err}). It takes: {params}."
        ) from err
    for name, value in kwargs.items():  # a parameter typed Literal[...] takes only those values
        allowed = _literal_values(target, name)
        if allowed and value not in allowed:
            choices = ", ".join(map(repr, allowed))
            raise PipelineError(f"{key}.{name} must be one of {choices}, got {value!r} ({node['_target_']}).")


def _literal_values(target: Any, name: str) -> tuple:
    """The values a ``Literal[...]`` annotation of ``target``'s parameter ``name`` allows, else ()."""
    try:
        hint = typing.get_type_hints(target).get(name)
    except Exception:  # annotations that do not resolve: nothing to check
        return ()
    return typing.get_args(hint) if typing.get_origin(hint) is typing.Literal else ()


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise PipelineError(message)


def _unwrap_optional(hint: Any) -> Any:
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
            raise PipelineError(f"{path}{key}: unknown key. {path.rstrip('.') or 'The config'} takes: {allowed}.")
        hint = _unwrap_optional(hints[key])
        if dataclasses.is_dataclass(hint) and isinstance(value, dict):
            check_keys(value, hint, f"{path}{key}.")
        elif typing.get_origin(hint) is dict:
            item_type = _unwrap_optional(typing.get_args(hint)[1])
            if dataclasses.is_dataclass(item_type):
                for name, item in value.items():
                    if item is not None:
                        check_keys(item, item_type, f"{path}{key}.{name}.")


def validate(cfg: dict) -> None:
    """Check a resolved config (a plain dict) for what the schema cannot express: its values, then
    its pluggable parts."""
    check_values(cfg)
    check_targets(cfg)


def check_targets(cfg: dict) -> None:
    """Import the model's, loss's, optimizer's and scheduler's ``_target_`` and check their arguments bind
    (transforms are checked with the values, ``source.download`` where it runs). The imports are
    what costs here (the model's: torchvision), so a run does this while Ray starts."""
    check_target(cfg["model"], "model")
    check_target(cfg["task"]["loss"], "task.loss")
    check_target(cfg["optim"], "optim", runtime_args=("params",))
    if cfg["scheduler"] is not None:
        check_target(cfg["scheduler"], "scheduler", runtime_args=("optimizer", "total_steps"))


def check_task(task: dict, source: dict) -> None:
    """The task type and its metrics, the label's class count, and the feature column's form."""
    _require(
        task["type"] in TASK_CHOICES,
        f"task.type must be one of {', '.join(TASK_CHOICES)}, got {task['type']!r}.",
    )
    for name in task["metrics"]:
        _require(
            task_metric(task["type"], name) is not None,
            f"task.metrics: {name!r} is not a {task['type']} metric; choose from {TASK_CHOICES[task['type']]}.",
        )
    _require(len(task["metrics"]) >= 1, "task.metrics needs at least one metric.")
    classes = source["num_classes"]
    _require(classes is None or classes >= 2, f"source.num_classes must be >= 2 or null, got {classes}.")
    features = source["feature_column"]
    _require(
        isinstance(features, str)
        or (isinstance(features, list) and features and all(isinstance(f, str) for f in features)),
        f"source.feature_column must be a column name or a non-empty list of column names, got {features!r}.",
    )
    on_missing = source["on_missing"]
    _require(
        on_missing in ("raise", "drop", "mean"),
        f"source.on_missing must be raise, drop or mean, got {on_missing!r}.",
    )


def check_values(cfg: dict) -> None:
    """Unknown keys, values out of range and the transforms' ``_target_`` (cheap to import, and a
    bad argument there, such as ``on_error``, should fail before Ray starts): everything but the
    model's, optimizer's and scheduler's imports."""
    check_keys(cfg, PipelineConfig)
    for split in ("train", "valid"):
        for name, spec in active_steps(cfg["transforms"][split]).items():
            key = f"transforms.{split}.{name}.fn"
            check_target(spec["fn"], key, runtime_args=("batch",), class_runtime_args=())
            _require(spec["num_cpus"] >= 0, f"transforms.{split}.{name}.num_cpus must be >= 0.")
            _require(
                spec["batch_size"] is None or spec["batch_size"] > 0,
                f"transforms.{split}.{name}.batch_size must be > 0 or null.",
            )
            _require(
                spec["concurrency"] is None or spec["concurrency"] >= 1,
                f"transforms.{split}.{name}.concurrency must be >= 1 or null.",
            )
    check_task(cfg["task"], cfg["source"])
    metrics = list(epoch_metrics(cfg["task"]["type"], cfg["task"]["metrics"]))
    _require(
        cfg["optimized_metric"] in metrics,
        f"optimized_metric must be one of {', '.join(metrics)}, got {cfg['optimized_metric']!r}.",
    )
    scaling, ingest, train = cfg["scaling"], cfg["ingest"], cfg["train"]
    _require(
        cfg["source"]["on_missing"] != "mean" or ingest["standardize"],
        "source.on_missing=mean fills in the training mean that ingest.standardize computes: set "
        "ingest.standardize=true, or use source.on_missing=drop.",
    )
    _require(train["epochs"] >= 1, f"train.epochs must be >= 1, got {train['epochs']}.")
    _require(
        train["checkpoint_metric"] in (None, *metrics),
        f"train.checkpoint_metric must be null or one of {', '.join(metrics)}, got {train['checkpoint_metric']!r}.",
    )
    _require(
        train["checkpoint_mode"] in (None, "max", "min"),
        f"train.checkpoint_mode must be max, min or null, got {train['checkpoint_mode']!r}.",
    )
    _require(train["accumulate"] >= 1, f"train.accumulate must be >= 1, got {train['accumulate']}.")
    tracking = cfg["tracking"]
    _require(
        tracking["register_as"] is None or tracking["log_model"],
        "tracking.register_as registers the run's logged model: set tracking.log_model=true too.",
    )
    _require(
        not train["evaluate"] or tracking["log_model"],
        "train.evaluate evaluates the run's logged model: set tracking.log_model=true too.",
    )
    scale = cfg["finetune"]["backbone_lr_scale"]
    _require(scale >= 0, f"finetune.backbone_lr_scale must be >= 0, got {scale}.")
    _require(
        train["grad_clip"] is None or train["grad_clip"] > 0,
        f"train.grad_clip must be > 0 or null, got {train['grad_clip']}.",
    )
    _require(
        train["on_nonfinite"] in ("raise", "skip"),
        f"train.on_nonfinite must be raise or skip, got {train['on_nonfinite']!r}.",
    )
    stop = train["early_stop"]
    _require(
        stop["patience"] is None or stop["patience"] >= 1,
        f"train.early_stop.patience must be >= 1 or null, got {stop['patience']}.",
    )
    _require(
        stop["metric"] in (None, *metrics),
        f"train.early_stop.metric must be null or one of {', '.join(metrics)}, got {stop['metric']!r}.",
    )
    _require(stop["min_delta"] >= 0, f"train.early_stop.min_delta must be >= 0, got {stop['min_delta']}.")
    _require(train["max_failures"] >= -1, f"train.max_failures must be >= -1, got {train['max_failures']}.")
    _require(
        not train["resume"] or cfg["tracking"]["run_name"],
        "train.resume=true needs tracking.run_name: the name of the run to continue.",
    )
    _require(
        train["amp_dtype"] in ("bfloat16", "float16"),
        f"train.amp_dtype must be bfloat16 or float16, got {train['amp_dtype']!r}.",
    )
    _require(
        ingest["cache"] in (True, False, "auto"), f"ingest.cache must be auto, true or false, got {ingest['cache']!r}."
    )
    _require(0 < ingest["cache_share"] <= 1, f"ingest.cache_share must be in (0, 1], got {ingest['cache_share']}.")
    _require(scaling["num_workers"] >= 1, f"scaling.num_workers must be >= 1, got {scaling['num_workers']}.")
    _require(ingest["batch_size"] >= 1, f"ingest.batch_size must be >= 1, got {ingest['batch_size']}.")
    normalize = ingest["normalize"]
    _require(
        normalize is None or (len(normalize["mean"]) == len(normalize["std"]) and min(normalize["std"]) > 0),
        f"ingest.normalize needs one mean and one std > 0 per channel, got {normalize}.",
    )
    _require(
        ingest["batch_size"] % scaling["num_workers"] == 0,
        f"ingest.batch_size ({ingest['batch_size']}) is the global batch and must divide evenly "
        f"among scaling.num_workers ({scaling['num_workers']}).",
    )
    for key, s3 in (("source.s3", cfg["source"]["s3"]), ("storage.s3", cfg["storage"]["s3"])):
        _require(s3["max_attempts"] >= 1, f"{key}.max_attempts must be >= 1, got {s3['max_attempts']}.")
        _require(s3["connect_timeout_s"] > 0 and s3["request_timeout_s"] > 0, f"{key}: timeouts must be > 0.")
    limit = cfg["source"]["limit"]
    _require(limit is None or limit >= 1, f"source.limit must be >= 1 or null, got {limit}.")
    _require(
        cfg["stage"] in ("train", "predict", "evaluate"),
        f"stage must be train, predict or evaluate, got {cfg['stage']!r}.",
    )
    predict = cfg["predict"]
    _require(
        predict["batch_size"] >= 1 and predict["concurrency"] >= 1,
        "predict.batch_size and predict.concurrency must be >= 1.",
    )
