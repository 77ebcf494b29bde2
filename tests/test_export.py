"""train.export on the driver, without training: a ResNet's files load alone and match its eager outputs, and a model
that cannot be traced leaves its weights, the reason and a finished delivery (a trained ViT's and MLP's exports:
test_pipeline.py and test_finetune.py)."""

from __future__ import annotations

import json
import logging

import pyarrow.fs as pafs
import pytest
import torch
import torchvision
from conftest import compose_cfg
from exported import loaded_alone
from mlflow import MlflowClient

from pipeline.config import ExportFormat, NormalizeConfig
from pipeline.tracking import export, models
from pipeline.training.scaling import feature_scaler

BOTH = [ExportFormat.torch_export, ExportFormat.onnx]


class Branchy(torch.nn.Module):
    """A model whose forward branches on its input's values: torch.export cannot trace that."""

    def __init__(self, in_channels: int, **mlp):  # in wine_mlp's place: its settings come too
        super().__init__()
        self.linear = torch.nn.Linear(in_channels, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outputs = self.linear(x)
        return outputs if x.mean() > 0 else -outputs


def test_a_resnets_exports_load_without_this_repo_and_match_the_eager_model_on_64_images(tmp_path):
    torch.manual_seed(0)
    scale = feature_scaler(NormalizeConfig(), None, torch.device("cpu"))
    served = models.Scaled(torchvision.models.resnet18(num_classes=4), scale).eval()
    images = torch.randint(0, 256, (66, 3, 64, 64), dtype=torch.uint8)
    example, held_out = images[:2], images[2:]
    came_to = export.export_model(served, example, held_out, BOTH, str(tmp_path), {"input": {"column": "image"}})
    assert set(came_to) == set(BOTH) and "failed" not in " ".join(came_to.values()), came_to
    with torch.no_grad():
        eager = served(held_out).numpy()
    checked = loaded_alone(tmp_path, held_out.numpy(), eager, tmp_path)
    assert set(checked) == {"torch_export", "onnx"} and all(within for _, within in checked.values()), checked
    manifest = json.loads((tmp_path / "export.json").read_text())
    assert manifest["input"] == {"column": "image"} and manifest["checked"]["rows"] == 64
    assert manifest["checked"]["files"]["onnx"]["max_abs_diff"] == pytest.approx(checked["onnx"][0], abs=1e-6)


def test_a_model_that_cannot_be_traced_keeps_its_weights_and_says_why_and_its_delivery_finishes(
    tmp_path, caplog, monkeypatch
):
    """The LoggedModel holds the weights alone with the reason, the export names each format that failed, and
    the run's best model is still logged: a run with such a model finishes."""
    cfg = compose_cfg(["+experiment=wine_mlp", "model._target_=test_export.Branchy", f"paths.outputs={tmp_path}"])
    checkpoint_dir = tmp_path / "storage" / "checkpoint_000000"
    checkpoint_dir.mkdir(parents=True)
    weights = Branchy(in_channels=13).state_dict()  # wine_mlp's 13 features
    rows = torch.randn(64, 13)
    state = {"model": weights, "feature_statistics": None, "classes": None, "epoch": 0}
    torch.save({**state, "input_example": rows[:2], "held_out": rows}, checkpoint_dir / "checkpoint.pt")
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.create_experiment("branchy")
    run_id = client.create_run(experiment).info.run_id

    logged = models.CheckpointModels(client, experiment, run_id, cfg)
    model_id = logged.start(0, str(checkpoint_dir))
    for name in ("pipeline", "pipeline.tracking", "pipeline.tracking.models", "pipeline.tracking.export"):
        logger = logging.getLogger(name)  # heard as a run's log hears them, whatever an earlier test's config did
        monkeypatch.setattr(logger, "disabled", False)
        monkeypatch.setattr(logger, "propagate", True)
        monkeypatch.setattr(logger, "level", logging.NOTSET)
    with caplog.at_level(logging.WARNING):
        best = logged.finish(None, pafs.LocalFileSystem(), None, "max", None, None)

    assert best is not None and best.model_id == model_id
    model = client.get_logged_model(model_id)
    assert str(model.status) == "READY" and "GuardOnDataDependentSymNode" in model.tags[models.MODEL_ERROR_TAG]
    saved = torch.load(client.download_artifacts(run_id, "model/state_dict.pt", str(tmp_path)), weights_only=True)
    assert all(torch.equal(saved[k], weights[k]) for k in weights)
    tags = client.get_run(run_id).data.tags
    assert tags[models.BEST_MODEL_TAG] == model_id
    assert tags[export.EXPORT_TAG].startswith("torch_export: failed (") and "onnx" not in tags[export.EXPORT_TAG]
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "could not be saved as an MLflow model program" in said and "could not be exported as torch_export" in said
