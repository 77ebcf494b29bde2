"""Runs on the driver: the TorchTrainer built from the config, and ``fit()`` run to the end.

The workers run :func:`pipeline.training.worker.train_loop_per_worker`; while ``fit()`` runs, their events
reach the driver through :mod:`pipeline.training.relay`. Ray's own quirks are handled in
:mod:`pipeline.common.workarounds`.
"""

from __future__ import annotations

import ray
import ray.data
import ray.train
from ray.train import CheckpointConfig, DataConfig, FailureConfig, RunConfig
from ray.train.torch import TorchConfig, TorchTrainer
from ray.util.queue import Queue

from pipeline.common.metrics import lower_is_better
from pipeline.common.workarounds import explain, fit_off_main_thread
from pipeline.config import PipelineConfig, ScalingConfig, Strategy, TaskConfig, TrainConfig
from pipeline.data.preprocess import TrainingData
from pipeline.runtime.filesystems import RunStorage
from pipeline.training import checkpoint, finetune
from pipeline.training.finetune import Initial
from pipeline.training.relay import EventHandler, ReportRelay, relayed
from pipeline.training.worker import WorkerJob, steps_per_epoch, train_loop_per_worker


def trainer_settings(scaling: ScalingConfig) -> tuple[ray.train.ScalingConfig, TorchConfig]:
    """Ray's scaling and process-group settings: nccl on GPU workers, gloo on CPU workers; workers go
    only to nodes with their resources (custom ones included) and ``label_selector`` labels."""
    scaling_config = ray.train.ScalingConfig(
        num_workers=(scaling.min_workers, scaling.max_workers) if scaling.elastic else scaling.num_workers,
        elastic_resize_monitor_interval_s=scaling.elastic_resize_monitor_interval_s,
        use_gpu=scaling.use_gpu,
        resources_per_worker=dict(scaling.resources_per_worker),
        label_selector=dict(scaling.label_selector) or None,
    )
    return scaling_config, TorchConfig(backend="nccl" if scaling.use_gpu else "gloo")


def data_config(cfg: PipelineConfig) -> DataConfig:
    """How Ray Train executes the datasets it splits: Ray's defaults, unless the config changes them."""
    data_cpus = cfg.scaling.data_cpus
    execution_options = None
    if data_cpus is not None or cfg.ingest.preserve_order:
        execution_options = ray.data.ExecutionOptions(preserve_order=cfg.ingest.preserve_order)
        if data_cpus is not None:
            execution_options.resource_limits = ray.data.ExecutionResources(cpu=data_cpus)
    return DataConfig(execution_options=execution_options)


def build_trainer(
    cfg: PipelineConfig,
    data: TrainingData,
    storage: RunStorage,
    events: Queue,
    callbacks: list,
    initial: Initial | None,
) -> TorchTrainer:
    """A TorchTrainer for the typed config; workers send their events to ``events``; ``callbacks``
    run in Ray Train's controller besides the one that relays each report to ``events``; ``initial``
    (the weights training starts from) goes to Ray's object store once, for every worker: with FSDP, every
    tensor of the model, built here (the workers build theirs on the meta device and take their shards)."""
    scaling_config, torch_config = trainer_settings(cfg.scaling)
    if cfg.scaling.strategy == Strategy.fsdp:
        initial = finetune.whole_start(cfg.model, cfg.finetune, initial, cfg.train.seed)
    return TorchTrainer(
        train_loop_per_worker,
        train_loop_config={
            "job": WorkerJob(
                cfg=cfg,
                events=events,
                coordinator=data.coordinator,
                statistics=data.statistics,
                train_rows=data.rows["train"],
                initial=ray.put(initial) if initial is not None else None,
                saved=saved_checkpoint(storage),
            )
        },
        scaling_config=scaling_config,
        torch_config=torch_config,
        datasets=data.datasets,
        dataset_config=data_config(cfg),
        run_config=RunConfig(
            name=storage.name,
            storage_path=storage.path,
            storage_filesystem=storage.filesystem,
            checkpoint_config=CheckpointConfig(
                num_to_keep=cfg.train.num_to_keep,
                checkpoint_score_attribute=cfg.train.checkpoint_metric,
                checkpoint_score_order=checkpoint_mode(cfg.train, cfg.task),
            ),
            failure_config=FailureConfig(max_failures=cfg.train.max_failures),
            callbacks=[ReportRelay(events), *callbacks],
        ),
    )


def saved_checkpoint(storage: RunStorage) -> ray.train.Checkpoint | None:
    """The newest whole checkpoint already in the run's storage (a resumed run's), for the workers to
    continue from when Ray Train restores an older one or none (:func:`pipeline.training.worker.restore_point`)."""
    path = checkpoint.newest(storage.filesystem, f"{storage.path}/{storage.name}")
    return None if path is None else ray.train.Checkpoint(path, filesystem=storage.filesystem)


def checkpoint_mode(train: TrainConfig, task: TaskConfig) -> str:
    """``train.checkpoint_mode``, or, when null, min for a loss or an error metric and max otherwise."""
    if train.checkpoint_mode is not None:
        return train.checkpoint_mode
    metric = train.checkpoint_metric
    return "min" if metric is not None and lower_is_better(task.type, task.metrics, metric) else "max"


def epoch_steps(cfg: PipelineConfig, data: TrainingData) -> int:
    """Batches each worker sees per epoch of this job (elastic: with the most workers it allows)."""
    scaling, ingest = cfg.scaling, cfg.ingest
    return steps_per_epoch(data.rows["train"], scaling.max_workers, ingest.batch_size, ingest.drop_last)


def fit(
    cfg: PipelineConfig,
    data: TrainingData,
    storage: RunStorage,
    handler: EventHandler | None,
    initial: Initial | None = None,
    callbacks: tuple = (),
) -> ray.train.Result:
    """Train to the end, handing every worker event to ``handler`` (:class:`pipeline.jobs.train.JobEvents` for
    a job; none for a Tune trial, whose reports reach Tune); a worker or controller failure becomes one PipelineError
    naming its cause. ``initial``: the weights training starts from (None: random ones). ``callbacks``:
    more Ray Train callbacks (a Tune trial's TuneReportCallback)."""
    events = Queue(actor_options={"num_cpus": 0})
    try:
        trainer = build_trainer(cfg, data, storage, events, list(callbacks), initial)
        with relayed(events, handler):
            try:
                return fit_off_main_thread(trainer)
            except ray.train.TrainingFailedError as err:
                raise explain(err) from err
    finally:
        ray.kill(events.actor)
