"""MLflow models of a training run (on the driver): each kept checkpoint as an MLflow 3 LoggedModel of the
run, the best one registered under an alias, and an MLflow model URI read back as files.

A LoggedModel is MLflow's pytorch flavor saved as a ``torch.export`` program ("pt2") with its signature and
an input example: ``mlflow.pytorch.load_model(uri)`` loads it without this repo's code, and nothing pickled
runs. The program includes the input scaling training applied, so it takes features as the transforms
wrote them (uint8 pixels, raw table values). Beside it, ``extra_files/state_dict.pt`` holds the weights
as a state dict: what fine-tuning and prediction read (``weights_only=True``).
"""

from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import dataclass
from importlib.metadata import version

import mlflow
import pyarrow.fs as pafs
import ray.train
import torch
from hydra.utils import instantiate
from mlflow import MlflowClient
from mlflow.entities import LoggedModelOutput
from mlflow.exceptions import MlflowException
from mlflow.models import Model, infer_signature

from pipeline.common.errors import PipelineError, redact
from pipeline.common.workarounds import global_tracking_uri, import_mlflow_pytorch
from pipeline.config import PipelineConfig
from pipeline.tracking import export
from pipeline.training import checkpoint
from pipeline.training.scaling import feature_scaler

log = logging.getLogger(__name__)
mlflow_pytorch = import_mlflow_pytorch()

MODEL_URI_SCHEMES = ("runs:/", "models:/")  # runs:/RUN_ID/PATH, models:/NAME@ALIAS, models:/NAME/VERSION, models:/ID
WEIGHTS_FILE = "state_dict.pt"  # a logged model's weights as a state dict
CHECKPOINT_TAG = "pipeline.checkpoint"  # on a LoggedModel: the checkpoint it was made from, in the run's storage
EPOCH_TAG = "pipeline.epoch"  # on a LoggedModel: the epoch (its step in the run)
BEST_MODEL_TAG = "pipeline.model_id"  # on a run: its best LoggedModel, the weights of its model/state_dict.pt
MODEL_ERROR_TAG = "pipeline.model_error"  # on a LoggedModel holding weights alone (and its run): why


@dataclass(frozen=True)
class Kept:
    """A kept checkpoint's LoggedModel."""

    model_id: str
    epoch: int
    checkpoint: str  # the checkpoint's path in the run's storage


class Scaled(torch.nn.Module):
    """The model behind the input scaling training applied (``ingest.normalize``, ``ingest.standardize``)."""

    def __init__(self, model: torch.nn.Module, scale):
        super().__init__()
        self.model, self.scale = model, scale

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.model(self.scale(features))


def served_model(cfg: PipelineConfig, state: dict) -> Scaled:
    """A checkpoint's model (``state``: :func:`pipeline.training.checkpoint.load_whole`'s) behind the scaling it was
    trained with, on the CPU, in eval mode: what a LoggedModel and its exports hold."""
    model = instantiate(cfg.model, _convert_="all")
    model.load_state_dict(checkpoint.handed_on(state))
    scale = feature_scaler(cfg.ingest.normalize, state["feature_statistics"], torch.device("cpu"))
    return Scaled(model, scale).eval()


def log_checkpoint(client: MlflowClient, run_id: str, cfg: PipelineConfig, local: str, kept: Kept) -> None:
    """The checkpoint in the local directory ``local`` as the LoggedModel ``kept.model_id`` (made by
    :func:`start_model`): pt2 program, signature, input example, weights; READY once its files are in."""
    state = checkpoint.load_whole(local, "tracking.log_model")
    served, example = served_model(cfg, state), state["input_example"]
    with torch.no_grad():
        signature = infer_signature(example.numpy(), served(example).numpy())
    metadata = {"task": str(cfg.task.type), "feature": cfg.source.feature_column, "epoch": kept.epoch}
    if state["classes"] is not None:
        metadata["classes"] = state["classes"]  # output i is classes[i]
    with tempfile.TemporaryDirectory() as tmp:
        weights = os.path.join(tmp, WEIGHTS_FILE)
        torch.save(checkpoint.handed_on(state), weights)
        files = os.path.join(tmp, "model")
        mlflow_pytorch.save_model(
            served,
            files,
            mlflow_model=Model(run_id=run_id, model_id=kept.model_id, model_uuid=kept.model_id, metadata=metadata),
            signature=signature,
            input_example=example.numpy(),
            pip_requirements=[f"{name}=={version(name).split('+')[0]}" for name in ("torch", "torchvision")],
            extra_files=[weights],
            serialization_format="pt2",
        )
        client.log_model_artifacts(kept.model_id, files)
    client.finalize_logged_model(kept.model_id, "READY")


def start_model(client: MlflowClient, run_id: str, experiment_id: str, epoch: int, checkpoint: str) -> Kept:
    """A new LoggedModel ``checkpoint-<epoch>`` of the run, its output at step ``epoch``: the epoch's
    metrics logged with its id are linked to it."""
    model = client.create_logged_model(
        experiment_id,
        name=f"checkpoint-{epoch}",
        source_run_id=run_id,
        tags={CHECKPOINT_TAG: checkpoint, EPOCH_TAG: str(epoch)},
    )
    client.log_outputs(run_id, models=[LoggedModelOutput(model.model_id, step=epoch)])
    return Kept(model.model_id, epoch, checkpoint)


def kept_models(client: MlflowClient, experiment_id: str, run_id: str) -> tuple[list[Kept], list[Kept]]:
    """The run's checkpoints' LoggedModels (a resumed run's earlier ones), by epoch: those that hold their
    files, and those still waiting for them (the run was interrupted before training ended)."""
    ready, pending, token = [], [], None
    while True:
        page = client.search_logged_models([experiment_id], f"source_run_id = '{run_id}'", page_token=token)
        for model in page:
            if EPOCH_TAG in model.tags:
                kept = Kept(model.model_id, int(model.tags[EPOCH_TAG]), model.tags[CHECKPOINT_TAG])
                (ready if str(model.status) == "READY" else pending).append(kept)
        if not page.token:
            return sorted(ready, key=lambda k: k.epoch), sorted(pending, key=lambda k: k.epoch)
        token = page.token


def register_model(client: MlflowClient, run_id: str, name: str, alias: str | None, model_id: str) -> str:
    """The LoggedModel ``model_id`` as a new version of the registered model ``name`` (created the first
    time), with ``alias`` moved to it when given; the version. A run registers one version: the one it has
    (a delivery cut off after registering) is kept."""
    version = registered_version(client, name, run_id)
    if version is None:
        try:
            client.create_registered_model(name)
        except MlflowException as err:
            if err.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        with global_tracking_uri(client.tracking_uri):
            version = client.create_model_version(
                name, source=f"models:/{model_id}", run_id=run_id, model_id=model_id
            ).version
    if alias:
        client.set_registered_model_alias(name, alias, version)
    return version


def registered_version(client: MlflowClient, name: str, run_id: str) -> str | None:
    """The version of the registered model ``name`` that the run registered, if any."""
    versions = client.search_model_versions(f"run_id = '{run_id}'")  # a run id is hex: no quoting needed
    return max((v.version for v in versions if v.name == name), key=int, default=None)


def model_source(client: MlflowClient, uri: str) -> tuple[str, str | None, str]:
    """The run that logged the model an MLflow model URI names, its LoggedModel (None for a run's
    artifacts) and the artifact URI of its files: ``runs:/RUN_ID/PATH`` (a run's artifacts: ``model`` is
    its best checkpoint's, that run's ``pipeline.model_id``), ``models:/NAME@ALIAS``,
    ``models:/NAME/VERSION`` (a registered version) or ``models:/MODEL_ID`` (a LoggedModel)."""
    if uri.startswith("runs:/"):
        run_id, _, path = uri.removeprefix("runs:/").partition("/")
        tags = client.get_run(run_id).data.tags
        return run_id, tags.get(BEST_MODEL_TAG) if path.rstrip("/") == "model" else None, uri
    model_id = uri.removeprefix("models:/").rstrip("/")
    if "@" in model_id or "/" in model_id:
        if "@" in model_id:
            version = client.get_model_version_by_alias(*model_id.split("@", 1))
        else:
            version = client.get_model_version(*model_id.rsplit("/", 1))
        if not version.source.startswith("models:/"):  # a version registered from a run's artifacts
            return version.run_id, None, version.source
        model_id = version.source.removeprefix("models:/")
    model = client.get_logged_model(model_id)
    return model.source_run_id, model_id, model.artifact_location


def download_model(client: MlflowClient, uri: str, into: str) -> str:
    """The files of the MLflow model ``uri`` names, downloaded into the directory ``into``; their path."""
    try:
        *_, files = model_source(client, uri)
        return mlflow.artifacts.download_artifacts(artifact_uri=files, dst_path=into, tracking_uri=client.tracking_uri)
    except (MlflowException, OSError, ValueError) as err:
        raise PipelineError(
            f"cannot read the MLflow model {uri} from the store {redact(client.tracking_uri)} ({err}). "
            "runs:/RUN_ID/model names a run's best model; models:/NAME@ALIAS or models:/NAME/VERSION a registered one "
            "(tracking.register_as); models:/MODEL_ID a checkpoint's (the run's Logged models)."
        ) from err


def model_weights(client: MlflowClient, uri: str, into: str) -> str:
    """The state dict file of the MLflow model ``uri`` names, downloaded into the directory ``into``."""
    files = download_model(client, uri, into)
    found = sorted(os.path.join(root, WEIGHTS_FILE) for root, _, names in os.walk(files) if WEIGHTS_FILE in names)
    if not found:
        raise PipelineError(f"the MLflow model {uri} holds no {WEIGHTS_FILE}: this pipeline did not log it.")
    return found[0]


def log_model(client: MlflowClient, run_id: str, checkpoint_dir: str) -> None:
    """A checkpoint's weights as the run's ``model/state_dict.pt``, loadable with ``torch.load(weights_only=True)``."""
    state = checkpoint.load_whole(checkpoint_dir, "tracking.log_model")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, WEIGHTS_FILE)
        torch.save(checkpoint.handed_on(state), path)
        client.log_artifact(run_id, path, "model")


class CheckpointModels:
    """A run's checkpoints as LoggedModels, the policy in one place: one is made as each checkpoint's epoch
    is logged (the epoch's metrics link to it); once training ends they get their files, those of checkpoints
    Ray Train no longer keeps are deleted, and the best becomes the run's model and, with ``register_as``, a
    registered version."""

    def __init__(self, client: MlflowClient, experiment_id: str, run_id: str, cfg: PipelineConfig):
        self.client, self.experiment_id, self.run_id, self.cfg = client, experiment_id, run_id, cfg
        self.kept, self.pending = kept_models(client, experiment_id, run_id)  # a resumed run's earlier ones too

    def start(self, epoch: int, checkpoint: str) -> str:
        """The LoggedModel for the checkpoint (a path in the run's storage) of ``epoch``: the one the run
        has (a delivery cut off after making it), else a new one; its id."""
        ready, pending = kept_models(self.client, self.experiment_id, self.run_id)
        kept = next((k for k in ready + pending if k.epoch == epoch and k.checkpoint == checkpoint), None)
        if kept is None:
            kept = start_model(self.client, self.run_id, self.experiment_id, epoch, checkpoint)
        if kept not in self.pending + self.kept:
            (self.kept if kept in ready else self.pending).append(kept)
        return kept.model_id

    def finish(
        self,
        keep: set[str] | None,
        filesystem,
        metric: str | None,
        mode: str,
        register_as: str | None,
        alias: str | None,
    ) -> Kept | None:
        """Once training has ended: the files saved (:meth:`save`), the best chosen (:meth:`best`) and logged as the
        run's model, registered as ``register_as`` with ``alias`` moved to it; the best, None when none was kept."""
        self.save(keep, filesystem)
        best = self.best(metric, mode)
        if best is not None:
            self.log_best(best, filesystem, register_as, alias)
        return best

    def save(self, keep: set[str] | None, filesystem) -> None:
        """The pending LoggedModels get their files, once training has ended (``torch.export`` takes the GIL for
        seconds, which would slow training and the driver's answer to Ctrl-C). Those of checkpoints Ray Train no
        longer keeps (not in ``keep``, when given: ``train.num_to_keep``) are deleted, as are those whose
        checkpoint is gone. A model MLflow cannot save as a program keeps its weights alone (:meth:`weights_only`)."""
        for kept in [k for k in self.kept if keep is not None and k.checkpoint not in keep]:
            self.forget(kept)
            self.kept.remove(kept)
        for kept in list(self.pending):  # each taken off once done: a save the server cut off goes on from there
            dropped = keep is not None and kept.checkpoint not in keep
            if dropped or filesystem.get_file_info(kept.checkpoint).type == pafs.FileType.NotFound:
                self.forget(kept)
                self.pending.remove(kept)
                continue
            with ray.train.Checkpoint(kept.checkpoint, filesystem).as_directory() as local:
                try:
                    log_checkpoint(self.client, self.run_id, self.cfg, local, kept)
                except Exception as err:  # torch.export cannot trace every model: its weights alone, saying why
                    self.weights_only(kept, local, err)
            self.pending.remove(kept)
            self.kept.append(kept)

    def weights_only(self, kept: Kept, local: str, err: Exception) -> None:
        """A checkpoint whose model MLflow's pt2 flavor cannot save (``torch.export`` cannot trace it): its
        LoggedModel holds the weights alone (what prediction and fine-tuning read), and it and the run carry why."""
        why = export.reason(err)
        log.warning(
            "tracking.log_model: checkpoint-%d could not be saved as an MLflow model program (%s); its LoggedModel "
            "holds the weights alone (%s: prediction, evaluation and fine-tuning read them), and mlflow.pyfunc cannot "
            "load it. The run still finishes. torch.export's docs list what it cannot trace: data-dependent Python "
            "control flow above all.",
            kept.epoch,
            why,
            WEIGHTS_FILE,
        )
        state = checkpoint.load_whole(local, "tracking.log_model")
        with tempfile.TemporaryDirectory() as tmp:
            torch.save(checkpoint.handed_on(state), os.path.join(tmp, WEIGHTS_FILE))
            self.client.log_model_artifacts(kept.model_id, tmp)
        self.client.set_logged_model_tags(kept.model_id, {MODEL_ERROR_TAG: why})
        self.client.set_tag(self.run_id, MODEL_ERROR_TAG, f"checkpoint-{kept.epoch}: {why}")
        self.client.finalize_logged_model(kept.model_id, "READY")

    def export(self, kept: Kept, local: str) -> None:
        """The best checkpoint (in the local directory ``local``) as ``train.export``'s files in its LoggedModel's
        ``export/``, each checked against the eager model on the checkpoint's held-out validation rows; what each
        format came to in the run's tag ``pipeline.export`` (a format that fails does not fail the run)."""
        state = checkpoint.load_whole(local, "train.export")
        served, example = served_model(self.cfg, state), state["input_example"]
        held_out = state.get("held_out")
        held_out = example if held_out is None else held_out  # a checkpoint from before held-out rows were kept
        expects = export.expected_input(self.cfg, example, state["feature_statistics"], state["classes"])
        with tempfile.TemporaryDirectory() as into:
            came_to = export.export_model(served, example, held_out, self.cfg.train.export, into, expects)
            self.client.log_model_artifacts(kept.model_id, into, export.EXPORT_DIR)
        summary = "; ".join(f"{fmt}: {what}" for fmt, what in came_to.items())
        self.client.set_tag(self.run_id, export.EXPORT_TAG, summary)
        log.info("exported checkpoint-%d: %s", kept.epoch, summary)

    def forget(self, kept: Kept) -> None:
        """Delete a LoggedModel whose checkpoint is not kept (gone already: a delete the server cut off)."""
        try:
            self.client.delete_logged_model(kept.model_id)
        except MlflowException as err:
            if err.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise

    def best(self, metric: str | None, mode: str) -> Kept | None:
        """The kept checkpoint best by ``metric`` (``mode``: max or min; the earliest of equals), or the
        latest without one; None when none was logged."""
        if metric is None or not self.kept:
            return self.kept[-1] if self.kept else None
        value = {m.step: m.value for m in self.client.get_metric_history(self.run_id, metric)}
        return (max if mode == "max" else min)(self.kept, key=lambda kept: value[kept.epoch])

    def log_best(self, kept: Kept, filesystem, register_as: str | None, alias: str | None) -> None:
        """The kept checkpoint's weights as the run's ``model/state_dict.pt``; with ``register_as``, its
        LoggedModel a new registered version, ``alias`` moved to it (a sweep moves its alias to its best
        job's version when it ends: sweep.py)."""
        with ray.train.Checkpoint(kept.checkpoint, filesystem).as_directory() as local:
            log_model(self.client, self.run_id, local)
            if self.cfg.train.export:
                self.export(kept, local)
        self.client.set_tag(self.run_id, BEST_MODEL_TAG, kept.model_id)
        if register_as is not None:
            version = register_model(self.client, self.run_id, register_as, alias, kept.model_id)
            log.info(
                "registered checkpoint-%d as %s version %s%s",
                kept.epoch,
                register_as,
                version,
                f" (models:/{register_as}@{alias})" if alias else "",
            )
