"""Every check of a training job that can fail on the user's input, before its MLflow run exists, in the order
they run. Before Ray starts (each in the module that owns the setting):

- the config's values and their combinations (:func:`pipeline.config.check_values`);
- each ``_target_`` imported and its arguments bound (:func:`pipeline.config.check_targets`);
- a step marked ``streamed: false`` runs once (:func:`pipeline.data.steps.check_streamed`);
- a step put on the training device can go there, and so can each after it (:func:`pipeline.data.steps.check_device`);
- the splits' files, columns, labels and class names (:func:`pipeline.data.source.prepare`);
- the blocks FSDP shards and activation checkpointing recomputes (:func:`pipeline.training.parallel.check_blocks`);
- ``finetune.weights`` read and matched to the model (:func:`start_weights`).

The command line's job (:func:`pipeline.api.run_job`) runs these first (:func:`before_ray`), then begins Ray's start,
and the rest run while Ray starts and the job's modules import; should one fail, Ray is shut down before its error:

- the rows evaluation scores, with ``train.evaluate`` (:func:`pipeline.jobs.predict.prediction_split`);
- ``storage.path`` made or reached (:func:`pipeline.runtime.filesystems.make_dir`).

Then Ray is up, and :mod:`pipeline.runtime.checks` checks what needs it.
"""

from __future__ import annotations

import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import ray

from pipeline.common.errors import PipelineError
from pipeline.common.startup import Startup
from pipeline.config import PipelineConfig, check_targets, check_values
from pipeline.data import source, steps
from pipeline.runtime import checks, cluster
from pipeline.runtime.filesystems import make_dir

if TYPE_CHECKING:
    from pipeline.training import finetune

# The checks after before_ray import what they need (torch, MLflow: seconds) inside: pipeline.api imports this
# module for before_ray, then begins Ray's start, and only then imports the job's modules.


@dataclass(frozen=True)
class Inputs:
    """What :func:`before_ray` checked: the splits (each with its steps) and the weights training starts from."""

    splits: dict[str, source.Split]
    initial: finetune.Initial | None


def before_ray(cfg: PipelineConfig) -> Inputs:
    """The config's values, ``_target_`` callables and blocks, the splits it names, with their files' footers, and
    the weights it starts from: every check of what the user wrote that does not need Ray. A helper thread imports
    the targets (the model's: torchvision, seconds) while the footers are read."""
    from pipeline.training import parallel

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="preflight") as helper:
        targets = helper.submit(check_targets, cfg)
        splits = sources(cfg)
        targets.result()
    parallel.check_blocks(cfg.model, cfg.train, cfg.scaling)
    return Inputs(splits, start_weights(cfg))


def check(
    cfg: PipelineConfig, startup: Startup | None = None, inputs: Inputs | None = None
) -> tuple[dict[str, source.Split], finetune.Initial | None]:
    """The checks above, Ray started or joined, then the checks that need it; returns the checked splits and the
    weights training starts from, or raises a PipelineError before anything is recorded, Ray shut down if it
    started for this job. ``inputs``: :func:`before_ray`'s, when the caller ran it and began Ray's start
    (:func:`pipeline.runtime.cluster.start_early`); ``startup`` is told when each part is done.

    A helper thread opens the MLflow store (a new SQLite store creates its tables) while Ray starts."""
    from pipeline.jobs import predict
    from pipeline.tracking import mlflow_store

    startup = startup or Startup()
    try:
        inputs = inputs or before_ray(cfg)
        startup.mark("sources")
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="preflight") as helper:
            if cfg.train.evaluate:
                predict.prediction_split(cfg, evaluating=True)
            storage = cfg.storage.path
            if storage is not None:
                make_dir(storage, cfg.storage.s3, "storage.path")
            wanted = cluster.runtime(cfg.ray, cfg.scaling)
            store = helper.submit(mlflow_store.connect, cfg.tracking.uri, cfg.paths.outputs)  # cached per URI
            cluster.connect(wanted)
            store.result()
    except BaseException:
        cluster.abandon_start()
        raise
    startup.mark("ray_up")
    if wanted.address is None:  # a cluster may autoscale; a local runtime never grows
        checks.check_resources(ray.cluster_resources(), wanted, transform_cpus(inputs.splits))
    shared = {f"source.{name}": split.files[0] for name, split in inputs.splits.items() if split.local}
    checks.check_shared(wanted.address, {**shared, "storage.path": storage})
    return inputs.splits, inputs.initial


def sources(cfg: PipelineConfig) -> dict[str, source.Split]:
    """The config's values checked, then its splits found and their files' footers read: every check that needs
    neither Ray nor the model. Each split carries its active transform steps."""
    active = {name: cfg.transforms.active(name) for name in source.SPLITS}
    check_values(cfg)
    for name in source.SPLITS:
        steps.check_streamed(name, active[name])
        steps.check_device(name, active[name])
    splits = source.prepare(cfg.source)
    for name, split in splits.items():
        split.steps = active[name]
    return splits


def transform_cpus(splits: dict[str, source.Split]) -> float:
    """The most CPUs one transform step of the job asks for (0 without steps)."""
    return max((s.num_cpus for split in splits.values() for s in split.steps.values()), default=0)


def start_weights(cfg: PipelineConfig) -> finetune.Initial | None:
    """The weights a job starts from (``finetune.weights``, read and matched to the model), or None. An MLflow
    model is downloaded from the job's store first."""
    from pipeline.tracking import mlflow_store, models
    from pipeline.training import finetune

    weights = cfg.finetune.weights
    with tempfile.TemporaryDirectory() as tmp:
        files = None
        if weights is not None and weights.startswith(models.MODEL_URI_SCHEMES):
            client, _ = mlflow_store.connect(cfg.tracking.uri, cfg.paths.outputs)
            try:
                files = models.model_weights(client, weights, tmp)
            except PipelineError as err:
                raise PipelineError(f"finetune.weights: {err}") from err
        return finetune.initial_weights(cfg.model, cfg.finetune, files)
