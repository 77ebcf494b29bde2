"""The config's schema: the typed shape of ``conf/``, registered as Hydra's ``schema`` config, so a wrong
type or an unknown key fails at composition. The one place every default is set, with its comment;
``conf/`` holds only what a choice (a source, a model, GPU scaling, an experiment) changes. Pluggable
parts (``_target_`` nodes) are free-form here; :mod:`pipeline.config.targets` checks them.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import MISSING

CONF_DIR = str(Path(__file__).resolve().parents[2] / "conf")


class Choice(str, enum.Enum):
    """A setting with a fixed set of values: Hydra refuses any other, naming the valid ones. A ``str`` whose
    value is its name: it compares, formats and is logged as that value."""

    def __str__(self) -> str:
        return self.value


# the functional form where a value is a Python keyword ("raise")
OnMissing = Choice("OnMissing", {name: name for name in ("raise", "drop", "mean")})
OnNonfinite = Choice("OnNonfinite", {name: name for name in ("raise", "skip")})
AmpDtype = Choice("AmpDtype", {name: name for name in ("bfloat16", "float16")})
CheckpointMode = Choice("CheckpointMode", {name: name for name in ("max", "min")})
TaskType = Choice("TaskType", {name: name for name in ("classification", "regression")})
Stage = Choice("Stage", {name: name for name in ("train", "predict", "evaluate")})
Strategy = Choice("Strategy", {name: name for name in ("ddp", "fsdp")})
CompileMode = Choice(  # torch.compile's modes
    "CompileMode", {name: name for name in ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")}
)
CheckpointUpload = Choice("CheckpointUpload", {name: name for name in ("async", "sync")})
ExportFormat = Choice("ExportFormat", {name: name for name in ("torch_export", "onnx")})


@dataclass(kw_only=True)
class S3Config:
    """How to reach S3 or an S3-compatible store. There are no credential fields on purpose: the AWS
    SDK reads them from the environment, AWS_PROFILE or an instance role (pipeline/runtime/filesystems.py)."""

    region: Optional[str] = None  # null: the AWS SDK's default (AWS_DEFAULT_REGION, profile, us-east-1)
    endpoint_url: Optional[str] = "${oc.env:AWS_ENDPOINT_URL,null}"  # MinIO, Ceph, R2: http(s)://host:port
    anonymous: bool = False  # public buckets; s3://anonymous@bucket/... does the same per path
    connect_timeout_s: float = 5.0  # an unreachable endpoint fails after about this x max_attempts
    request_timeout_s: float = 30.0
    max_attempts: int = 3


@dataclass(kw_only=True)
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
    on_missing: OnMissing = OnMissing["raise"]
    limit: Optional[int] = None  # cap on rows per split
    download: Optional[Any] = None  # _target_ callable(root) that fetches the data when it is missing
    reader_v2: bool = False  # prediction: Ray Data's V2 parquet reader (starts footer-reader actors: slower)
    task_per_file: bool = True  # prediction: one read task per file, which also runs the transforms
    s3: S3Config = field(default_factory=S3Config)  # used when a split is an s3:// URI


@dataclass(kw_only=True)
class TransformSpec:
    fn: Any = MISSING  # _target_ node: a function (run as Ray tasks) or a class (run as an actor pool)
    num_cpus: float = 1.0  # CPUs per preprocessing task/actor, separate from the training workers
    batch_size: Optional[int] = None  # rows per call of a class's actor pool and of prediction's steps; null:
    # whole blocks (prediction reads a file, decodes and transforms it in one task). Training's function steps
    # run on the rows each gathering task hands on
    concurrency: Optional[int] = None  # tasks at once (functions) or actor pool size (classes); null: Ray's
    # run once and kept in Ray's object store (ingest.cache), or every epoch; null: every epoch when the
    # function takes an `epoch` (seeded augmentation), else once. Steps after an every-epoch one run every epoch.
    cache: Optional[bool] = None
    # false: the step runs only to fill the cache (a working size the next step crops from); a split that
    # streams skips it, and the next step takes the rows as read (random_resized_crop decodes them itself)
    streamed: bool = True
    resources: dict[str, float] = field(default_factory=dict)  # custom resources per task, e.g. {cpu_node: 1}:
    label_selector: dict[str, str] = field(default_factory=dict)  # ...or node labels: where the step may run
    # where a step that runs every epoch runs: auto (on the training device when the workers have GPUs or read the
    # cache themselves, one node, and the function has a device form: transforms/device.py), true (on the training
    # device, whatever it is: then it runs every epoch, not from the cache), false (in Ray Data's CPU tasks). Steps
    # after a device step run there too
    on_device: Any = "auto"


@dataclass
class TransformsConfig:
    train: dict[str, Optional[TransformSpec]] = field(default_factory=dict)  # null drops a step
    valid: dict[str, Optional[TransformSpec]] = field(default_factory=dict)

    def active(self, split: str) -> dict[str, TransformSpec]:
        """A split's steps (train or valid, which predict's rows go through too), without those an overlay dropped."""
        steps = self.valid if split == "valid" else self.train
        return {name: spec for name, spec in steps.items() if spec is not None}


@dataclass
class EarlyStopConfig:
    """Stop training once ``metric`` has gone ``patience`` epochs without improving by more than ``min_delta``."""

    patience: Optional[int] = None  # epochs without improvement before stopping; null: never stop early
    metric: Optional[str] = None  # any metric an epoch reports (val_loss, val_accuracy, ...); null: optimized_metric
    min_delta: float = 0.0  # smaller improvements do not count


@dataclass(kw_only=True)
class ProfileConfig:
    """Where a few training steps' time goes (docs/performance.md, "Where the time went"): torch.profiler on rank 0
    for ``active`` steps of one epoch, after ``wait`` skipped and ``warmup`` discarded; the trace (Perfetto,
    TensorBoard) and a table of the operators, and Ray Data's per-operator stats of every epoch, in the run's
    artifacts under profile/."""

    enabled: bool = False
    epoch: int = 1  # the epoch profiled (from 1)
    wait: int = 3  # its first steps, not profiled: the data and the allocator warming up
    warmup: int = 2  # then profiled and thrown away: the profiler's own start-up
    active: int = 5  # then recorded
    row_limit: int = 25  # operators in the table, by their own time


@dataclass(kw_only=True)
class TrainConfig:
    epochs: int = 1
    seed: int = 0
    amp: bool = False  # autocast on GPU workers; ignored on CPU
    amp_dtype: AmpDtype = AmpDtype.bfloat16  # or float16 (which adds a GradScaler)
    # best checkpoints kept (the latest is always kept too); null keeps all, which needs checkpoint_every=null
    num_to_keep: Optional[int] = 2
    checkpoint_metric: Optional[str] = None  # what "best" means, e.g. val_accuracy; null: the most recent
    evaluate: bool = False  # then stage=evaluate with the run's best model, in a run nested under it
    checkpoint_mode: Optional[CheckpointMode] = None  # max or min of checkpoint_metric; null: min for losses, errors
    max_failures: int = 0  # worker-group restarts from the latest checkpoint before the run fails; -1: no limit
    resume: bool = False  # continue the run named tracking.run_name from its latest checkpoint
    grad_clip: Optional[float] = None  # clip the gradients' global L2 norm to this before each step; null: no clip
    accumulate: int = 1  # batches per optimizer step (gradient accumulation: DDP all-reduces only on the last)
    # rows per forward and backward within a worker's batch (accumulated: the batch, its optimizer step and the LR
    # schedule unchanged): a number; auto (start with the whole batch, halve on out of memory and run the batch
    # again, every rank alike; the size is logged as micro_batch and kept in checkpoints); null: the whole batch
    micro_batch: Optional[str] = None
    # a loss or gradient that is NaN or inf: raise (the run fails, naming the epoch and step) or skip (that
    # optimizer step is not taken; counted per epoch as skipped_steps)
    on_nonfinite: OnNonfinite = OnNonfinite["raise"]
    early_stop: EarlyStopConfig = field(default_factory=EarlyStopConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    # the GPU levers (docs/performance.md, "GPU levers": when each pays): torch.compile each worker's model (its
    # first steps compile, for seconds to minutes), with one of torch.compile's modes
    compile: bool = False
    compile_mode: CompileMode = CompileMode["default"]
    activation_checkpointing: bool = False  # recompute each block's activations in backward: less memory, more compute
    # the model's repeated blocks, by class name or dotted path: the units FSDP shards and activation checkpointing
    # recomputes; null: torchvision's ViT EncoderBlock, ResNet BasicBlock and Bottleneck, and Linear (the MLP)
    blocks: Optional[list[str]] = None
    # async: the next epoch starts while Ray Train uploads the checkpoint to storage.path (Ray's
    # checkpoint_upload_mode); sync: training waits for each upload
    checkpoint_upload: CheckpointUpload = CheckpointUpload["async"]
    # a checkpoint within the epoch as well, at an optimizer step: every "10 min" of training, or "500 steps" (or
    # 500): a machine lost without notice costs at most that; a resumed run continues from the step it reached, each
    # of the epoch's other rows once; null: off (docs/troubleshooting.md, "A stopped run continues from its step")
    checkpoint_every: Optional[str] = "10 min"
    # on SIGTERM or Ctrl-C, the workers checkpoint at the step they are on; the driver records the stop, then waits
    # at most stop_grace_s for it (a second signal ends the wait): 25 s fits a 404 MB one to S3 (12 s on 2 cores)
    # within Slurm's, Kubernetes' and a spot VM's 30 s (docs/troubleshooting.md, "A stopped run"; bench/notice.py)
    checkpoint_on_stop: bool = True
    stop_grace_s: float = 25.0
    # the best model's serving files, in its LoggedModel's export/ (docs/models.md, "Exporting"), each checked
    # against the eager model: torch_export (a .pt2 program: torch alone loads it, no pickle, the same kernels) and
    # onnx (for runtimes outside Python; needs pip install '.[onnx]'); []: none
    export: list[ExportFormat] = field(default_factory=lambda: [ExportFormat.torch_export])
    # an exponential moving average of the weights on each worker, after every optimizer step: its decay (0.999:
    # about the last 1,000 steps' weights), validated and checkpointed beside the trained weights; null: off
    ema: Optional[float] = None
    # with ema: the averages are the run's model (its val_* scores, the best checkpoint, the logged models and what
    # predict reads), the trained weights' scores raw_val_*; false: the trained weights are, the averages' ema_val_*
    ema_model: bool = True

    def other_weights(self) -> str | None:
        """With ``ema``, the prefix of the scores of the weights that are not the run's model (``raw``, ``ema``)."""
        if self.ema is None:
            return None
        return "raw" if self.ema_model else "ema"

    def micro_rows(self) -> tuple[int | None, bool]:
        """``micro_batch`` as (rows per forward and backward, or None for the whole batch; whether ``auto``)."""
        if self.micro_batch is None or str(self.micro_batch) == "auto":
            return None, self.micro_batch is not None
        if not str(self.micro_batch).isdigit() or int(self.micro_batch) < 1:
            raise ValueError(
                f"train.micro_batch must be a number of rows (>= 1), auto or null; got {self.micro_batch!r}."
            )
        return int(self.micro_batch), False

    def step_checkpoints(self) -> tuple[int | None, float | None]:
        """``checkpoint_every`` as (optimizer steps, seconds), one of them set, or (None, None) when off."""
        if self.checkpoint_every is None:
            return None, None
        found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(steps?|min)?\s*", str(self.checkpoint_every))
        if found is None or float(found[1]) <= 0 or (found[2] != "min" and not found[1].isdigit()):
            raise ValueError(
                f"train.checkpoint_every must be a number of steps (500, '500 steps') or of minutes ('10 min'), "
                f"more than 0, or null; got {self.checkpoint_every!r}."
            )
        return (None, float(found[1]) * 60) if found[2] == "min" else (int(found[1]), None)


@dataclass
class FinetuneConfig:
    """Where training starts and what of the model trains (docs/models.md, "Fine-tuning"); weights are read on the
    driver before Ray starts, as tensors only."""

    # null: random weights. Else a torchvision weight name for model._target_ (IMAGENET1K_V1, DEFAULT), a
    # state dict or checkpoint.pt file, or an MLflow model: runs:/RUN_ID/model, models:/NAME@ALIAS, models:/NAME/1
    weights: Optional[str] = None
    # parameter-name patterns (fnmatch) of the head, which starts fresh where its shape differs from the
    # weights' (another class count); empty: the model's last layer with parameters (docs/models.md names it)
    head: list[str] = field(default_factory=list)
    freeze: list[str] = field(default_factory=list)  # parameter-name patterns kept as loaded, e.g. "conv1.*"
    # the rest of the model (the backbone) learns at this fraction of the head's rate (optim.lr, the schedule's)
    backbone_lr_scale: float = 1.0


@dataclass(kw_only=True)
class ScalingConfig:
    # a count, or [MIN, MAX]: elastic (Ray Train starts with what the cluster has, MIN at least, and resizes
    # from the latest checkpoint as nodes come and go; docs/cluster.md)
    num_workers: Any = 2
    use_gpu: bool = False
    # ddp: each worker holds a whole replica; fsdp: FSDP2 shards the parameters, gradients and optimizer state
    # over the workers, per block (train.blocks), for models that do not fit one device
    strategy: Strategy = Strategy.ddp
    resources_per_worker: dict[str, float] = field(default_factory=lambda: {"CPU": 0.5})
    label_selector: dict[str, str] = field(default_factory=dict)  # node labels training workers need
    data_cpus: Optional[float] = None  # CPU budget for Ray Data preprocessing; null: what training leaves
    torch_threads: Optional[int] = None  # intra-op threads per worker; null: Ray's default
    elastic_resize_monitor_interval_s: float = 60.0  # elastic: how often Ray Train looks for room to grow
    # Ray Train's local mode: a one-worker run trains in the driver's process, with no worker group to start.
    # auto: when nothing needs a group (one DDP worker, no restarts, one node, the driver's own GPU); true:
    # always (a setting that needs a group fails); false: never (docs/configuration.md)
    local_mode: Any = "auto"

    def needs_worker_group(self, max_failures: int) -> str | None:
        """What of these settings needs Ray Train's worker group rather than its local mode, or None."""
        extra = set(self.resources_per_worker) - {"CPU", "GPU"}
        reasons = {
            f"scaling.num_workers={self.num_workers}": self.num_workers != 1,
            "scaling.strategy=fsdp": self.strategy != Strategy.ddp,
            f"train.max_failures={max_failures} (a lost worker restarts)": max_failures != 0,
            "scaling.label_selector (the worker's node chosen by label)": bool(self.label_selector),
            f"scaling.resources_per_worker's {', '.join(sorted(extra))}": bool(extra),
        }
        return next((reason for reason, needed in reasons.items() if needed), None)

    @property
    def min_workers(self) -> int:
        return self.num_workers if isinstance(self.num_workers, int) else self.num_workers[0]

    @property
    def max_workers(self) -> int:
        return self.num_workers if isinstance(self.num_workers, int) else self.num_workers[-1]

    @property
    def elastic(self) -> bool:
        return not isinstance(self.num_workers, int)

    @property
    def worker_counts(self) -> range:
        """Every size the worker group may have."""
        return range(self.min_workers, self.max_workers + 1)


@dataclass
class NormalizeConfig:
    mean: list[float] = field(default_factory=lambda: [0.5, 0.5, 0.5])
    std: list[float] = field(default_factory=lambda: [0.5, 0.5, 0.5])


@dataclass(kw_only=True)
class IngestConfig:
    batch_size: int = 128  # global: each of N workers gets batch_size / N rows per step
    prefetch_batches: int = 2
    # rows each training worker draws its batches from at random, across read tasks (Ray Data's local shuffle);
    # auto: the fewest rows that mix the labels as the most a quarter of the smallest object store holds do (among
    # the workers, at the size rows reach them): a few batches of rows stored mixed; of rows stored by class on one
    # node, most splits whole, a full shuffle. With ingest.shuffle; null: none
    local_shuffle_buffer_size: Any = "auto"
    drop_last: bool = False
    preserve_order: bool = False  # deterministic block order (reproducible runs) at some throughput cost
    # uint8 pixels travel as they are (a quarter of float32's bytes) and become (x/255 - mean) / std on the
    # training device; null: features reach the model as they are
    normalize: Optional[NormalizeConfig] = field(default_factory=NormalizeConfig)  # (uint8 features only)
    # each row in a new seeded order every epoch, whatever the file layout (class-sorted files included);
    # costs some ingest speed (docs/performance.md)
    shuffle: bool = True
    # run each split's deterministic steps (decoding, resizing: see TransformSpec.cache) once and keep their
    # output in Ray's object store, so later epochs run only the random steps: auto (on when the estimate,
    # from the first rows, fits cache_share of the store), true (fail before training when it does not), false
    cache: Any = "auto"
    # of the preprocessing nodes' object stores the cache may take; Ray Data streams through the rest
    cache_share: float = 0.5
    # MiB of stored rows each of an epoch's read tasks reads and mixes together (row groups drawn from all over the
    # split, a new draw every epoch): more mixes a split stored by class better, and holds more in the task's memory
    read_task_mib: float = 64.0
    # scale float features by the training split's per-feature mean and std (computed before training,
    # saved with the run and applied by predict too): for tables of numbers
    standardize: bool = False


@dataclass
class TaskConfig:
    """What the model learns, which sets the loss, the metrics and what a prediction is (conf/task/)."""

    type: TaskType = TaskType.classification  # classification (integer labels) or regression (numeric labels)
    loss: Any = field(default_factory=lambda: {"_target_": "torch.nn.CrossEntropyLoss"})  # any torch loss module
    # reported as val_<name>: classification accuracy, topK_accuracy (top5_accuracy); regression mae, mse, rmse
    metrics: list[str] = field(default_factory=lambda: ["accuracy"])


@dataclass(kw_only=True)
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
    # training never waits on the tracking server (its writes are spooled on disk); a finished run waits this
    # long for an unanswering server to take its record, then leaves it for `python -m pipeline.sync`
    server_wait_s: float = 300.0


@dataclass(kw_only=True)
class RayConfig:
    address: Optional[str] = "${oc.env:RAY_ADDRESS,null}"  # null: a local runtime; auto, HOST:PORT, ray://...
    # logical CPUs of a local runtime; null: the machine's cores plus the training workers' CPUs, so
    # preprocessing may use the cores a waiting worker leaves idle (data_wait_fraction judges: docs/performance.md)
    num_cpus: Optional[int] = None
    object_store_memory: Optional[int] = None  # bytes, a local runtime's; null: Ray's default (30% of RAM)
    py_modules: list[str] = field(default_factory=lambda: ["pipeline", "transforms"])  # shipped to a cluster
    runtime_env: dict[str, Any] = field(default_factory=dict)  # Ray's runtime_env for the job (pip, env_vars...)


@dataclass(kw_only=True)
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


@dataclass(kw_only=True)
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
    stage: Stage = Stage.train
    predict: PredictConfig = field(default_factory=PredictConfig)
    optimized_metric: str = "val_${task.metrics[0]}"  # what the entry point returns to a sweeper (Optuna)
