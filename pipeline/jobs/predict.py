"""Predict stage: a trained run's model over a parquet source, as a Ray Data actor pool.

``python -m pipeline +experiment=NAME stage=predict [predict.run=RUN]`` (``stage=evaluate``: the same, over
a labelled source, plus where the model errs: :mod:`pipeline.tracking.scores`). Each actor builds the model
from the training run's logged config and loads its weights once, then labels batches as the
source's rows stream past the same decode steps validation used. Predictions are written as parquet;
the job is an MLflow run nested under the training run, with accuracy when the source has labels.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import ray
import ray.data
import torch
from hydra.utils import instantiate
from mlflow.entities import LoggedModelInput
from mlflow.exceptions import MlflowException
from ray.exceptions import RayTaskError, UserCodeException

from pipeline.common import console
from pipeline.common.errors import PipelineError, redact, root_cause
from pipeline.config import (
    Layout,
    NormalizeConfig,
    PipelineConfig,
    PredictConfig,
    S3Config,
    Stage,
    TaskConfig,
    TrainConfig,
    validate,
)
from pipeline.data import preprocess, source, steps
from pipeline.jobs.job import JobResult
from pipeline.runtime import checks, cluster
from pipeline.runtime.filesystems import locate
from pipeline.tracking import delivery, lineage, liveness, mlflow_store, models, run_config, scores, tracker
from pipeline.training.checkpoint import handed_on, is_checkpoint
from pipeline.training.checkpoint import load as load_state
from pipeline.training.precision import autocast_settings
from pipeline.training.scaling import feature_scaler
from pipeline.training.task import Task, prediction_metrics

log = logging.getLogger(__name__)
STAGE_TAG = "pipeline.stage"
PREDICTIONS_TAG = "pipeline.predictions"  # where the run's predictions are
MODEL_ARTIFACT = "model/state_dict.pt"
STATISTICS_ARTIFACT = lineage.STATISTICS_ARTIFACT
NOT_TASK_METRICS = ("predict_rows", "predict_throughput")


class Predictor:
    """One model replica, built and loaded once per actor, then called on each batch."""

    def __init__(
        self,
        *,
        model_cfg: dict,
        task_cfg: TaskConfig,
        weights: list,
        normalize: NormalizeConfig | None,
        statistics: dict | None,
        feature: str,
        label: str | None,
        use_gpu: bool,
        train_cfg: TrainConfig,
        classes: list[str] | None = None,
    ):
        self.device = torch.device("cuda" if use_gpu and torch.cuda.is_available() else "cpu")
        model = instantiate(model_cfg, _convert_="all")
        model.load_state_dict(ray.get(weights[0]))  # [ObjectRef]: fetched here, from the object store
        self.model = model.to(self.device).eval()
        self.task = Task(task_cfg)
        self.autocast, _ = autocast_settings(self.device, train_cfg)
        self.scale = feature_scaler(normalize, statistics, self.device)  # as training scaled them
        self.feature, self.label = feature, label
        self.classes = np.asarray(classes) if classes is not None else None  # predictions written as these names

    @torch.inference_mode()
    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        features = self.scale(torch.as_tensor(batch[self.feature], device=self.device))
        with self.autocast:
            outputs = self.model(features)
        out = {"path": batch["path"], **self.task.predict(outputs)}
        if self.classes is not None:
            out["prediction"] = self.classes[out["prediction"]]
        if self.label is not None:
            out[self.label] = batch[self.label]
        return out


def actor_options(predict: PredictConfig, use_gpu: bool) -> dict:
    """Ray Data's map_batches options for the replicas: pool size, CPUs, a GPU each on GPU runs, placement."""
    num_gpus = predict.num_gpus if predict.num_gpus is not None else (1 if use_gpu else 0)
    return {
        "compute": ray.data.ActorPoolStrategy(size=predict.concurrency),
        "num_cpus": predict.num_cpus,
        "num_gpus": num_gpus,
        "batch_size": predict.batch_size,
        **steps.placement(predict),
    }


def model_run(client, model: str):
    """The run that trained ``model``: an MLflow model URI's (``models:/NAME@ALIAS``, ``models:/NAME/VERSION``,
    ``models:/MODEL_ID``, ``runs:/RUN_ID/model``), else the run of that id; None when no run has that id."""
    if model.startswith(models.MODEL_URI_SCHEMES):
        try:
            return client.get_run(models.model_source(client, model)[0])
        except MlflowException as err:
            raise PipelineError(f"predict.run: no MLflow model {model} in this store ({err.message}).") from err
    try:
        return client.get_run(model)
    except MlflowException:
        return None


def trained_run(client, experiment: str, name_or_id: str | None):
    """The run to predict with: ``name_or_id`` (an MLflow model URI, a run id, else the newest run of that
    name), or the experiment's newest finished training run."""
    if name_or_id is not None:
        run = model_run(client, name_or_id)
        if run is not None:
            return run
        found = mlflow_store.runs_where(
            client, experiment, "run_name", name_or_id, order_by=["attributes.start_time DESC"], max_results=1
        )
        if not found:
            raise PipelineError(f"predict.run: no run with the id or name {name_or_id!r} in this experiment.")
        return found[0]
    finished = client.search_runs(
        [experiment],
        filter_string="attributes.status = 'FINISHED'",
        order_by=["attributes.start_time DESC"],
        max_results=100,
    )
    for run in finished:
        if mlflow_store.STORAGE_TAG in run.data.tags:  # only training runs record their checkpoint storage
            return run
    raise PipelineError(
        "predict: this experiment has no finished training run; train one first, or name one with "
        "predict.run=NAME, or give predict.checkpoint=PATH."
    )


def scored_model(client, run, predict: PredictConfig) -> str | None:
    """The LoggedModel whose weights predict uses: the one ``predict.run`` names as an MLflow model URI,
    else the run's best; None for ``predict.checkpoint``."""
    if predict.checkpoint is not None:
        return None
    if predict.run is not None and predict.run.startswith(models.MODEL_URI_SCHEMES):
        return models.model_source(client, predict.run)[1]
    return run.data.tags.get(models.BEST_MODEL_TAG)


def load_weights(client, run, checkpoint: str | None, uri: str | None = None) -> tuple[dict, dict | None]:
    """The model's state dict and the feature statistics training standardized with (None when it did
    not), from ``checkpoint`` (a pipeline checkpoint.pt, its directory, or a bare state dict), the MLflow
    model ``uri`` names, or else the run's logged model; statistics from the run's ``feature_statistics.json``
    where the weights do not hold them; always ``weights_only``."""
    with tempfile.TemporaryDirectory() as tmp:
        if checkpoint is None and uri is not None and uri.startswith(models.MODEL_URI_SCHEMES):
            path = models.model_weights(client, uri, tmp)
        elif checkpoint is None:
            try:
                path = client.download_artifacts(run.info.run_id, MODEL_ARTIFACT, tmp)
            except (MlflowException, OSError) as err:
                raise PipelineError(
                    f"predict.run: run {run.info.run_name!r} ({run.info.run_id}) has no {MODEL_ARTIFACT} (it did not "
                    "finish, or tracker.log_model was false). Give a checkpoint instead: predict.checkpoint=PATH "
                    "(its pipeline.storage tag says where its checkpoints are)."
                ) from err
        else:
            path = checkpoint
        state = load_state(path, "predict.checkpoint" if checkpoint else "predict.run")
        if is_checkpoint(state):
            return handed_on(state), state.get("feature_statistics")
        statistics = None
        if run is not None and any(a.path == STATISTICS_ARTIFACT for a in client.list_artifacts(run.info.run_id)):
            with open(client.download_artifacts(run.info.run_id, STATISTICS_ARTIFACT, tmp)) as file:
                statistics = json.load(file)
    return state, statistics


def model_config(caller: PipelineConfig, model: str) -> tuple[PipelineConfig, str]:
    """``pipeline.predict`` and ``pipeline.evaluate``'s config: the logged config of the run that trained ``model``
    (a run id or an MLflow model URI), so its source's splits, steps, model and task, with the caller's stage,
    ``predict``, ``tracking``, ``paths``, ``ray`` and ``scaling``; and the name of the run's experiment, where the
    scoring run is nested under it."""
    client, uri = mlflow_store.connect(caller.tracking.uri, caller.paths.outputs)
    run = model_run(client, model)
    if run is None:
        raise PipelineError(
            f"{caller.stage}: {model!r} is neither a run id nor an MLflow model URI in the store {redact(uri)}. Give "
            "a training run's id (pipeline.train(...).run_id), its best model (runs:/RUN_ID/model, the result's "
            "model_uri) or a registered one (models:/NAME@ALIAS, models:/NAME/VERSION); MLFLOW_TRACKING_URI or "
            "tracking.uri=... names another store."
        )
    trained = run_config.logged_config(client, run.info.run_id)
    scored = dataclasses.replace(
        trained,
        stage=caller.stage,
        predict=dataclasses.replace(caller.predict, run=model),
        tracking=caller.tracking,
        paths=caller.paths,
        ray=caller.ray,
        scaling=caller.scaling,
    )
    return scored, client.get_experiment(run.info.experiment_id).name


def table_source(table, directory: str) -> str:
    """An in-memory table (pandas or pyarrow) written as one parquet file in ``directory``, for ``predict.source``."""
    if not isinstance(table, pa.Table):
        table = pa.Table.from_pandas(table, preserve_index=False)
    os.makedirs(directory, exist_ok=True)
    pq.write_table(table, os.path.join(directory, "rows.parquet"))
    return directory


def check_output(uri: str, s3: S3Config) -> None:
    """Predictions go to a new or empty directory, so no earlier run's files mix with them."""
    fs, path = locate(uri, s3, "predict.output")
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.Directory and fs.get_file_info(pafs.FileSelector(path, recursive=False)):
        raise PipelineError(f"predict.output: {uri} already holds files; choose a new directory or remove it.")
    if info.type == pafs.FileType.File:
        raise PipelineError(f"predict.output: {uri} is a file; it must be a directory.")
    fs.create_dir(path, recursive=True)


def written(uri: str, s3: S3Config, columns: list[str] | None = None) -> pa.Table:
    """The predictions as written (``columns`` of them; None: all), read back in the source's row order."""
    fs, path = locate(uri, s3, "predict.output")
    files = sorted(i.path for i in fs.get_file_info(pafs.FileSelector(path)) if i.path.endswith(".parquet"))
    if not files:  # no rows, no files
        return pa.table({column: pa.array([]) for column in columns or ["prediction"]})
    return pa.concat_tables([pq.read_table(f, filesystem=fs, columns=columns) for f in files])


def score(table: pa.Table, label: str | None, task: TaskConfig, seconds: float) -> dict:
    """Rows, rows/s and, with labels, the task's metrics (``predict_accuracy``, ``predict_mae``, ...)."""
    metrics = {"predict_rows": table.num_rows, "predict_throughput": table.num_rows / seconds}
    if label is not None and table.num_rows:
        found = prediction_metrics(task.type, task.metrics, table["prediction"].to_numpy(), table[label].to_numpy())
        metrics |= {f"predict_{name}": value for name, value in found.items()}
    return metrics


def prediction_split(cfg: PipelineConfig, evaluating: bool) -> tuple[str, source.Split, str | None]:
    """The rows to predict over: ``predict.source``, else ``source.test``, else ``source.valid``; the key
    that named them, the checked split and its label column (None where it has none: evaluating needs one)."""
    src = cfg.source
    key, where = next(
        (k, v)
        for k, v in (
            ("predict.source", cfg.predict.source),
            ("source.test", src.test),
            ("source.valid", src.valid),
        )
        if v
    )
    layout = dataclasses.replace(Layout.of(src), classes=None)  # labels as read: names stay names
    split = source.check_split(key, where, *locate(where, src.s3, key), columns=layout.inputs)
    split.layout, split.steps = layout, cfg.transforms.active("valid")
    label = layout.label if layout.label in split.columns else None
    if evaluating and label is None:
        raise PipelineError(
            f"stage=evaluate compares predictions with labels, but {key} {where} has no column {layout.label!r} "
            "(source.label_column)."
        )
    return key, split, label


def run(cfg: PipelineConfig, job) -> JobResult:
    """Predict over ``predict.source`` with a trained run's model; returns its run and the logged metrics."""
    console.quiet_libraries()
    predict, src = cfg.predict, cfg.source
    validate(cfg)
    store = mlflow_store.Store.open(cfg.tracking, cfg.paths.outputs, job.experiment, create=False)
    client, model_run = store.client, None
    if predict.run or not predict.checkpoint:
        if store.experiment_id is None:
            raise PipelineError(
                f"predict: there is no MLflow experiment {store.name!r} in {redact(store.uri)} "
                "to take a trained run from; train first, or give predict.checkpoint=PATH."
            )
        model_run = trained_run(client, store.experiment_id, predict.run)
    trained_cfg = run_config.logged_config(client, model_run.info.run_id) if model_run else cfg
    model_cfg, task_cfg = trained_cfg.model, trained_cfg.task
    weights, statistics = load_weights(client, model_run, predict.checkpoint, predict.run)
    classes = trained_cfg.source.classes  # the model's classes, by name where labels were names
    key, split, label = prediction_split(cfg, evaluating=cfg.stage == Stage.evaluate)
    output = predict.output or os.path.join(os.path.abspath(job.run_dir), "predictions")
    check_output(output, src.s3)
    cluster.connect(cluster.runtime(cfg.ray, cfg.scaling))
    checks.check_shared(cfg.ray.address, {key: split.files[0] if split.local else None, "predict.output": output})

    if store.experiment_id is None:  # predicting from a checkpoint file starts the experiment
        store = mlflow_store.Store.open(cfg.tracking, cfg.paths.outputs, job.experiment)
    name = cfg.tracking.run_name or f"{cfg.stage}: {model_run.info.run_name if model_run else predict.checkpoint}"
    parent = model_run.info.run_id if model_run else None
    tags = {STAGE_TAG: cfg.stage, PREDICTIONS_TAG: output, liveness.DRIVER_TAG: liveness.this_driver()}
    run_id = tracker.Tracker.start(store, cfg, job, name, parent, tags).run_id
    lineage.log_data(client, run_id, {"prediction": split}, None)
    model_id = scored_model(client, model_run, predict) if model_run else None
    if model_id is not None:  # the run, and its metrics, linked to the LoggedModel it scored
        client.log_inputs(run_id, models=[LoggedModelInput(model_id)])
    with mlflow_store.recorded(client, run_id):
        columns = [split.layout.model_input] + ([label] if label else []) + ["path"]
        rows = preprocess.dataset(split, steps.streamed_steps(split.steps), columns, src)
        predictor = {
            "model_cfg": model_cfg,
            "task_cfg": task_cfg,
            "weights": [ray.put(weights)],
            "normalize": cfg.ingest.normalize,
            "statistics": statistics,
            "feature": split.layout.model_input,
            "label": label,
            "use_gpu": cfg.scaling.use_gpu,
            "train_cfg": cfg.train,
            "classes": classes,
        }
        predictions = rows.map_batches(
            Predictor,
            fn_constructor_kwargs=predictor,
            batch_format="numpy",
            **actor_options(predict, cfg.scaling.use_gpu),
        )
        predictions.context.execution_options.preserve_order = True  # row i of the output is row i of the source
        fs, path = locate(output, src.s3, "predict.output")
        started = time.perf_counter()
        try:
            predictions.write_parquet(path, filesystem=fs)
        except (UserCodeException, RayTaskError) as err:  # a transform or the model failed on some rows
            raise PipelineError(f"prediction failed: {root_cause(err)}") from err
        seconds = time.perf_counter() - started
        table = written(output, src.s3, ["prediction"] + ([label] if label else []))
        metrics = score(table, label, task_cfg, seconds)
        if cfg.stage == Stage.evaluate:  # where it errs: per class, or its residuals
            every = classes or list(range(trained_cfg.source.num_classes or 0))  # what the model can predict
            metrics |= scores.report(client, run_id, table, label, task_cfg, every)
        measured_on = (lineage.dataset_name(split), split.digest)
        delivery.log_metrics(
            client, run_id, metrics, 0, model_id=model_id, dataset_of=dict.fromkeys(metrics, measured_on)
        )
    found = "".join(f", {k.removeprefix('predict_')} {v:.4f}" for k, v in metrics.items() if k not in NOT_TASK_METRICS)
    log.info("predicted %d rows%s; written to %s", metrics["predict_rows"], found, redact(output))
    return JobResult(run_id, metrics, predictions=output)
