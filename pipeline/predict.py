"""Predict stage: a trained run's model over a parquet source, as a Ray Data actor pool.

``python -m pipeline +experiment=NAME stage=predict [predict.run=RUN]``. Each actor builds the model
from the training run's logged config and loads its weights once, then labels batches as the
source's rows stream past the same decode steps validation used. Predictions are written as parquet;
the job is an MLflow run nested under the training run, with accuracy when the source has labels.
"""

from __future__ import annotations

import logging
import os
import pickle
import tempfile
import time

import numpy as np
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import ray
import ray.data
import torch
from hydra.utils import instantiate
from mlflow.exceptions import MlflowException
from ray.exceptions import RayTaskError, UserCodeException

from pipeline import cluster, console, preprocess, source, tracking, trainer, worker
from pipeline.config import PipelineError, validate
from pipeline.filesystems import locate

log = logging.getLogger(__name__)
STAGE_TAG = "pipeline.stage"
PREDICTIONS_TAG = "pipeline.predictions"  # where the run's predictions are
MODEL_ARTIFACT = "model/state_dict.pt"


class Predictor:
    """One model replica, built and loaded once per actor, then called on each batch."""

    def __init__(
        self,
        model_cfg: dict,
        weights: list,
        normalize: dict | None,
        feature: str,
        label: str | None,
        use_gpu: bool,
        train_cfg: dict,
    ):
        self.device = torch.device("cuda" if use_gpu and torch.cuda.is_available() else "cpu")
        model = instantiate(model_cfg, _convert_="all")
        model.load_state_dict(ray.get(weights[0]))  # [ObjectRef]: fetched here, from the object store
        self.model = model.to(self.device).eval()
        self.autocast, _ = worker.autocast_settings(self.device, train_cfg)
        self.scaling = worker.pixel_scaling(normalize, self.device) if normalize else None
        self.feature, self.label = feature, label

    @torch.inference_mode()
    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        features = torch.as_tensor(batch[self.feature], device=self.device)
        if self.scaling is not None:
            scale, shift = self.scaling
            features = features.float() * scale + shift
        with self.autocast:
            logits = self.model(features)
        confidence, prediction = torch.softmax(logits.float(), dim=1).max(dim=1)
        out = {"path": batch["path"], "prediction": prediction.cpu().numpy(), "confidence": confidence.cpu().numpy()}
        if self.label is not None:
            out[self.label] = batch[self.label]
        return out


def actor_options(predict: dict, use_gpu: bool) -> dict:
    """Ray Data's map_batches options for the replicas: pool size, CPUs, a GPU each on GPU runs, placement."""
    num_gpus = predict["num_gpus"] if predict["num_gpus"] is not None else (1 if use_gpu else 0)
    return {
        "compute": ray.data.ActorPoolStrategy(size=predict["concurrency"]),
        "num_cpus": predict["num_cpus"],
        "num_gpus": num_gpus,
        "batch_size": predict["batch_size"],
        **preprocess.placement(predict),
    }


def trained_run(client, experiment: str, name_or_id: str | None):
    """The run to predict with: ``name_or_id`` (a run id, else the newest run of that name), or the
    experiment's newest finished training run."""
    if name_or_id is not None:
        try:
            return client.get_run(name_or_id)
        except MlflowException:
            found = tracking.runs_where(
                client, experiment, "run_name", name_or_id, order_by=["attributes.start_time DESC"], max_results=1
            )
            if not found:
                raise PipelineError(
                    f"predict.run: no run with the id or name {name_or_id!r} in this experiment."
                ) from None
            return found[0]
    finished = client.search_runs(
        [experiment],
        filter_string="attributes.status = 'FINISHED'",
        order_by=["attributes.start_time DESC"],
        max_results=100,
    )
    for run in finished:
        if tracking.STORAGE_TAG in run.data.tags:  # only training runs record their checkpoint storage
            return run
    raise PipelineError(
        "predict: this experiment has no finished training run; train one first, or name one with "
        "predict.run=NAME, or give predict.checkpoint=PATH."
    )


def load_weights(client, run, checkpoint: str | None) -> dict:
    """The model's state dict, from ``checkpoint`` (a pipeline checkpoint.pt, its directory, or a bare
    state dict) or else the run's logged model; always ``weights_only``."""
    with tempfile.TemporaryDirectory() as tmp:
        if checkpoint is None:
            try:
                path = client.download_artifacts(run.info.run_id, MODEL_ARTIFACT, tmp)
            except (MlflowException, OSError) as err:
                raise PipelineError(
                    f"predict.run: run {run.info.run_name!r} ({run.info.run_id}) has no {MODEL_ARTIFACT} (it did not "
                    "finish, or tracking.log_model was false). Give a checkpoint instead: predict.checkpoint=PATH "
                    "(its pipeline.storage tag says where its checkpoints are)."
                ) from err
        else:
            path = os.path.join(checkpoint, worker.CHECKPOINT_FILE) if os.path.isdir(checkpoint) else checkpoint
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except (OSError, RuntimeError, pickle.UnpicklingError) as err:
            raise PipelineError(f"predict: cannot load weights from {path} ({err}).") from err
    return state["model"] if "model" in state and "optimizer" in state else state


def check_output(uri: str, s3: dict) -> None:
    """Predictions go to a new or empty directory, so no earlier run's files mix with them."""
    fs, path = locate(uri, s3, "predict.output")
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.Directory and fs.get_file_info(pafs.FileSelector(path, recursive=False)):
        raise PipelineError(f"predict.output: {uri} already holds files; choose a new directory or remove it.")
    if info.type == pafs.FileType.File:
        raise PipelineError(f"predict.output: {uri} is a file; it must be a directory.")
    fs.create_dir(path, recursive=True)


def score(uri: str, s3: dict, label: str | None, seconds: float) -> dict:
    """Rows, rows/s and, with labels, accuracy, read back from the written predictions."""
    fs, path = locate(uri, s3, "predict.output")
    table = pq.read_table(path, filesystem=fs, columns=["prediction"] + ([label] if label else []))
    metrics = {"predict_rows": table.num_rows, "predict_throughput": table.num_rows / seconds}
    if label is not None and table.num_rows:
        predicted, actual = table["prediction"].to_numpy(), table[label].to_numpy()
        metrics["predict_accuracy"] = float(np.mean(predicted == actual))
    return metrics


def run(cfg: dict, job) -> dict:
    """Predict over ``predict.source`` with a trained run's model; returns the logged metrics."""
    console.quiet_libraries()
    predict, src = cfg["predict"], cfg["source"]
    validate(cfg)
    client, uri = tracking.connect(cfg["tracking"]["uri"], cfg["paths"]["outputs"])
    experiment_name = cfg["tracking"]["experiment_name"] or job.experiment
    model_run = None
    if predict["run"] or not predict["checkpoint"]:
        found = client.get_experiment_by_name(experiment_name)
        if found is None:
            raise PipelineError(
                f"predict: there is no MLflow experiment {experiment_name!r} in {tracking.redact(uri)} "
                "to take a trained run from; train first, or give predict.checkpoint=PATH."
            )
        model_run = trained_run(client, found.experiment_id, predict["run"])
    model_cfg = tracking.logged_config(client, model_run.info.run_id)["model"] if model_run else cfg["model"]
    weights = load_weights(client, model_run, predict["checkpoint"])
    split = source.check_split("predict.source", predict["source"], [src["feature_column"]], src["s3"])
    label = src["label_column"] if src["label_column"] in split.columns else None
    output = predict["output"] or os.path.join(os.path.abspath(job.run_dir), "predictions")
    check_output(output, src["s3"])
    cluster.connect(cfg["ray"])
    cluster.check_shared(
        cfg["ray"]["address"], {"predict.source": split.files[0] if split.local else None, "predict.output": output}
    )

    experiment = tracking.experiment_id(client, uri, experiment_name, cfg["paths"]["outputs"])
    name = cfg["tracking"]["run_name"] or f"predict: {model_run.info.run_name if model_run else predict['checkpoint']}"
    run_id = tracking.start_run(
        client, experiment, name, model_run.info.run_id if model_run else None, job.overrides, tracking.CODE_DIR
    )
    client.set_tag(run_id, STAGE_TAG, "predict")
    client.set_tag(run_id, PREDICTIONS_TAG, output)
    tracking.log_config(client, run_id, cfg)
    with tracking.recorded(client, run_id):
        columns = [src["feature_column"]] + ([label] if label else []) + ["path"]
        rows = preprocess.dataset(split, cfg["transforms"]["valid"], columns, src)
        predictor = {
            "model_cfg": model_cfg,
            "weights": [ray.put(weights)],
            "normalize": cfg["ingest"]["normalize"],
            "feature": src["feature_column"],
            "label": label,
            "use_gpu": cfg["scaling"]["use_gpu"],
            "train_cfg": cfg["train"],
        }
        predictions = rows.map_batches(
            Predictor,
            fn_constructor_kwargs=predictor,
            batch_format="numpy",
            **actor_options(predict, cfg["scaling"]["use_gpu"]),
        )
        fs, path = locate(output, src["s3"], "predict.output")
        started = time.perf_counter()
        try:
            predictions.write_parquet(path, filesystem=fs)
        except (UserCodeException, RayTaskError) as err:  # a transform or the model failed on some rows
            raise PipelineError(f"prediction failed: {trainer.root_cause(err)}") from err
        metrics = score(output, src["s3"], label, time.perf_counter() - started)
        tracking.log_metrics(client, run_id, metrics, step=0)
    log.info(
        "predicted %d rows%s; written to %s",
        metrics["predict_rows"],
        f", accuracy {metrics['predict_accuracy']:.4f}" if "predict_accuracy" in metrics else "",
        tracking.redact(output),
    )
    return metrics
