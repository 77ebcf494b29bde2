"""The pipeline from Python, as the command line runs it: a notebook's or a script's way in.

    import pipeline
    result = pipeline.train("cifar_vit_cpu", overrides=["optim.lr=1e-3"])
    result.run_id, result.metrics["val_accuracy"], result.model_uri
    frame = pipeline.predict(result.model_uri)              # the run's validation rows: label, prediction, ...
    pipeline.evaluate(result.model_uri, "/data/holdout")   # a nested run with the confusion matrix

``python -m pipeline`` hands the config Hydra composed from its command line to the same :func:`run_job`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

from omegaconf import DictConfig

from pipeline.common.errors import PipelineError
from pipeline.config import CONF_DIR, PipelineConfig, Stage, check_overrides, load, register


def hydra_config(overrides: Sequence[str] = ()) -> DictConfig:
    """The config Hydra composes for ``python -m pipeline OVERRIDES``, outside ``@hydra.main``."""
    import hydra

    check_overrides(list(overrides))
    register()
    with hydra.initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return hydra.compose(config_name="config", overrides=list(overrides))


def compose(overrides: Sequence[str] = ()) -> PipelineConfig:
    """The typed config a stage is handed, for tests and benchmarks that build a job's parts themselves."""
    return typed_config(hydra_config(overrides))


def train(experiment: str | None = None, overrides: Sequence[str] = (), run_dir: str | None = None):
    """One training run, as ``python -m pipeline +experiment=EXPERIMENT OVERRIDES`` runs it, in this process:
    returns a :class:`pipeline.jobs.job.JobResult` (the MLflow run's id, its last epoch's metrics, its best
    model's URI). A mistake in the config raises :class:`pipeline.common.errors.PipelineError` before Ray starts;
    Ray started here stays up for the next call."""
    from pipeline.jobs.job import Job

    chosen = [f"+experiment={experiment}"] if experiment else []
    cfg = hydra_config([*chosen, *overrides])
    run_dir = run_dir or os.path.join(cfg.paths.outputs, "runs", time.strftime("%Y-%m-%d/%H-%M-%S"))
    return run_job(cfg, Job(run_dir, experiment or "default", overrides=[*chosen, *overrides], started_at=time.time()))


def predict(model: str, source=None, *, overrides: Sequence[str] = (), run_dir: str | None = None):
    """``model``'s predictions as ``stage=predict`` makes them, as a pandas DataFrame in the rows' order: ``path``,
    ``prediction`` (a class name where labels are names), ``confidence`` for classification, and the label where the
    rows have one; ``frame.attrs["run_id"]`` is the prediction's MLflow run, nested under the training run.
    ``model``: a training run's id or an MLflow model URI (``models:/NAME@ALIAS``, ``runs:/RUN_ID/model``).
    ``source``: parquet (a directory, file, glob or ``s3://`` URI) or an in-memory table (pandas, pyarrow) with the
    run's feature column; None: the run's ``source.test``, else its validation split. ``overrides``: the caller's
    ``predict.*``, ``tracking.*``, ``ray.*`` and ``scaling.*`` settings; the rest is the training run's logged
    config. Mistakes raise :class:`pipeline.common.errors.PipelineError` before Ray starts."""
    from pipeline.jobs import predict as job

    result, cfg = score(Stage.predict, model, source, overrides, run_dir)
    frame = job.written(result.predictions, cfg.source.s3).to_pandas()
    frame.attrs["run_id"] = result.run_id
    return frame


def evaluate(model: str, source=None, *, overrides: Sequence[str] = (), run_dir: str | None = None):
    """``model`` scored as ``stage=evaluate`` scores it, over labelled rows (``source`` as :func:`predict` takes
    it): a :class:`pipeline.jobs.job.JobResult` with the evaluation's MLflow run (nested under the training run, with
    the confusion matrix or the residuals) and its metrics (``predict_accuracy``, ``macro_f1``, ...)."""
    return score(Stage.evaluate, model, source, overrides, run_dir)[0]


def score(stage: Stage, model: str, source, overrides: Sequence[str], run_dir: str | None):
    """A predict or evaluate job for ``model`` over ``source`` (:func:`predict`), run in this process; its result
    and config."""
    from dataclasses import replace

    from pipeline.jobs import predict as job
    from pipeline.jobs.job import Job
    from pipeline.runtime import checks

    caller = load(hydra_config([f"stage={stage}", *overrides]))  # the store, Ray and predict settings
    cfg, experiment = job.model_config(caller, model)
    run_dir = run_dir or os.path.join(cfg.paths.outputs, "runs", time.strftime("%Y-%m-%d/%H-%M-%S"))
    if source is not None and not isinstance(source, str):
        source = job.table_source(source, os.path.join(run_dir, "rows"))
    cfg = replace(cfg, predict=replace(cfg.predict, source=source or cfg.predict.source))
    checks.check_outlives_job(cfg)
    return job.run(cfg, Job(run_dir, experiment, overrides=list(overrides), started_at=time.time())), cfg


def typed_config(raw: DictConfig) -> PipelineConfig:
    """The composed config as the schema's objects, a source's class names counted first (what the models'
    ``${source.num_classes}`` reads)."""
    from pipeline.data.source import with_classes

    with_classes(raw)
    return load(raw)


def run_job(raw: DictConfig, job):
    """The job ``cfg.stage`` names (train, or predict / evaluate), from the composed config: made typed once,
    checked where a submitted Ray job would lose its outputs, then run. A training job's config and sources are
    checked before Ray starts; Ray then starts while the job's modules import (torch, Ray Train, MLflow: seconds)."""
    from pipeline.jobs import preflight
    from pipeline.runtime import checks, cluster

    config = typed_config(raw)  # each stage gets the typed config: cfg.train.epochs
    checks.check_outlives_job(config)  # a submitted Ray job's working directory is deleted with it
    if config.stage in (Stage.predict, Stage.evaluate):
        from pipeline.jobs import predict

        return predict.run(config, job)
    try:
        inputs = preflight.before_ray(config)
    except PipelineError as err:  # as the job's later checks' are: a sweep's job is still recorded
        from pipeline.jobs.train import failed_before_run

        failed_before_run(config, job, err)
        raise
    job.startup.mark("sources")
    cluster.start_early(cluster.runtime(config.ray, config.scaling))
    try:
        from pipeline.jobs import train as training_job
    except BaseException:
        cluster.abandon_start()
        raise
    return training_job.run(config, job, inputs)
