"""Starting from weights by config: a model pretrained on one task, registered under an alias, fine-tuned
on a few rows of another task with another class count (head swapped, first layer frozen, the backbone
slower), against the same model from random weights; and each way weights are named, checked before Ray."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import mlflow
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import compose_cfg
from exported import best_model_exports
from mlflow import MlflowClient

from pipeline.common.errors import PipelineError
from pipeline.common.workarounds import global_tracking_uri
from pipeline.config import FinetuneConfig, PipelineConfig
from pipeline.jobs import predict, preflight
from pipeline.jobs.job import Job
from pipeline.jobs.train import run
from pipeline.tracking import models
from pipeline.training import finetune

FEATURES = [f"x{i}" for i in range(8)]


def write_xor(path: Path, rows: int, seed: int, classes: int) -> None:
    """Rows whose class is the signs of x0*x1 and, with 4 classes, of x2*x3: no linear model separates
    them, so a network needs hidden features for them, features that the 2-class task (x0*x1 alone) shares."""
    x = np.random.default_rng(seed).normal(size=(rows, len(FEATURES))).astype(np.float32)
    label = (x[:, 0] * x[:, 1] > 0).astype(np.int64)
    if classes == 4:
        label = label * 2 + (x[:, 2] * x[:, 3] > 0)
    path.mkdir(parents=True)
    pq.write_table(pa.table({**{n: x[:, i] for i, n in enumerate(FEATURES)}, "label": label}), path / "part.parquet")


def table_config(root: Path, outputs: Path, classes: int, overrides: list[str]) -> PipelineConfig:
    return compose_cfg(
        [
            "+experiment=wine_mlp",
            f"source.train={root}/train",
            f"source.valid={root}/valid",
            "source.download=null",
            f"source.feature_column=[{','.join(FEATURES)}]",
            "source.label_column=label",
            f"source.num_classes={classes}",
            "model.in_channels=8",
            f"paths.outputs={outputs}",
            *overrides,
        ]
    )


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory, ray_runtime) -> tuple[Path, dict]:
    """A 4-class model trained on 3,000 rows, its best epoch (by val_accuracy) registered as models:/xor@champion."""
    root = tmp_path_factory.mktemp("finetune")
    write_xor(root / "four" / "train", 3000, seed=0, classes=4)
    write_xor(root / "four" / "valid", 500, seed=1, classes=4)
    cfg = table_config(
        root / "four",
        root / "outputs",
        4,
        [
            "train.epochs=4",
            "train.checkpoint_metric=val_accuracy",
            "train.num_to_keep=2",  # the best two and the latest: one of the four dropped, at least
            "tracking.register_as=xor",
            "optim.lr=0.01",
            "train.export=[torch_export,onnx]",
        ],
    )
    metrics = run(cfg, Job(str(root / "pretrain"), "finetune")).metrics
    return root, metrics


def test_a_registered_model_fine_tunes_on_few_rows_of_another_class_count_and_beats_random_weights(pretrained):
    root, pretrain_metrics = pretrained
    assert pretrain_metrics["val_accuracy"] > 0.8  # chance: 0.25
    client = MlflowClient(f"sqlite:///{root / 'outputs' / 'mlflow.db'}")
    version = client.get_model_version_by_alias("xor", "champion")
    source_run = client.get_run(version.run_id)

    # the alias names the best checkpoint by train.checkpoint_metric, not merely the last
    storage = Path(source_run.data.tags["pipeline.storage"])
    kept = {p: torch.load(p, weights_only=True) for p in storage.glob("checkpoint_*/checkpoint.pt")}
    accuracy = {
        m.step: m.value for m in client.get_metric_history(source_run.info.run_id, "val_accuracy")
    }  # epoch -> value
    top = max(accuracy.values())
    best = [state["model"] for state in kept.values() if accuracy[state["epoch"]] == top]
    registered = torch.load(models.model_weights(client, "models:/xor@champion", str(root)), weights_only=True)
    assert any(all(torch.equal(registered[k], state[k]) for k in state) for state in best)
    assert not all(torch.equal(registered[k], v) for k, v in last_checkpoint(storage)["model"].items()) or (
        accuracy[max(accuracy)] == top
    )  # the last epoch's weights are registered only where the last epoch is (one of) the best
    # predict finds the run that logged the model by its alias
    assert predict.trained_run(client, "unused", "models:/xor@champion").info.run_id == source_run.info.run_id

    # the 2-class task: 40 training rows, 1,000 to validate on
    write_xor(root / "two" / "train", 40, seed=2, classes=2)
    write_xor(root / "two" / "valid", 1000, seed=3, classes=2)
    few_rows = ["train.epochs=4", "ingest.batch_size=8", "optim.lr=0.01"]
    tuned_cfg = table_config(
        root / "two",
        root / "outputs",
        2,
        [
            *few_rows,
            "finetune.weights=models:/xor@champion",
            "finetune.freeze=['0.*']",  # the MLP's first Linear
            "finetune.backbone_lr_scale=0.3",
            "tracking.run_name=tuned",
        ],
    )
    tuned = run(tuned_cfg, Job(str(root / "tuned"), "finetune")).metrics
    scratch_cfg = table_config(root / "two", root / "outputs", 2, [*few_rows, "tracking.run_name=scratch"])
    scratch = run(scratch_cfg, Job(str(root / "scratch"), "finetune")).metrics
    assert tuned["val_accuracy"] >= scratch["val_accuracy"] + 0.1, (tuned, scratch)
    assert tuned["val_accuracy"] > 0.8, tuned

    # the frozen layer is bit-identical to the registered weights; the rest trained; the head is new
    tuned_run = client.search_runs([source_run.info.experiment_id], "attributes.run_name = 'tuned'")[0]
    after = torch.load(
        client.download_artifacts(tuned_run.info.run_id, "model/state_dict.pt", str(root / "t")), weights_only=True
    )
    assert torch.equal(after["0.weight"], registered["0.weight"]) and torch.equal(after["0.bias"], registered["0.bias"])
    assert not torch.equal(after["3.weight"], registered["3.weight"])  # the second Linear: trained
    assert after["6.weight"].shape == (2, 64) and registered["6.weight"].shape == (4, 64)  # the head, swapped
    assert tuned_run.data.tags["pipeline.start_weights"] == (
        "started from models:/xor@champion; starting fresh (another shape): 6.bias, 6.weight"
    )
    assert tuned_run.data.params["finetune.weights"] == "models:/xor@champion"


LOAD_WITHOUT_THIS_REPO = """
import sys
sys.modules["pipeline"] = None  # an import of this repo's code fails
import mlflow, numpy as np, pyarrow.parquet as pq
mlflow.set_tracking_uri(sys.argv[1])
model = mlflow.pyfunc.load_model("models:/xor@champion")
table = pq.read_table(sys.argv[2])
features = np.stack([table[f"x{i}"].to_numpy() for i in range(8)], axis=1)
print(float((model.predict(features).argmax(1) == table["label"].to_numpy()).mean()))
"""


def test_each_kept_checkpoint_is_a_logged_model_linked_to_its_epoch_and_loads_without_this_repo(pretrained):
    root, _ = pretrained
    uri = f"sqlite:///{root / 'outputs' / 'mlflow.db'}"
    client = MlflowClient(uri)
    version = client.get_model_version_by_alias("xor", "champion")
    run = client.get_run(version.run_id)
    accuracy = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "val_accuracy")}
    kept_epochs = sorted(
        torch.load(p, weights_only=True)["epoch"]
        for p in Path(run.data.tags["pipeline.storage"]).glob("checkpoint_*/checkpoint.pt")
    )
    assert len(kept_epochs) < 4 and kept_epochs[-1] == 3  # train.num_to_keep=2 dropped some; the latest stays

    logged = client.search_logged_models([run.info.experiment_id], f"source_run_id = '{run.info.run_id}'")
    assert sorted(m.name for m in logged) == [f"checkpoint-{epoch}" for epoch in kept_epochs]
    for model in logged:
        epoch = int(model.name.removeprefix("checkpoint-"))
        linked = {m.key: m for m in model.metrics}
        assert linked["val_accuracy"].value == accuracy[epoch] and linked["val_accuracy"].step == epoch
        assert linked["val_accuracy"].dataset_name == "four/valid" and linked["train_loss"].dataset_name == "four/train"
        with global_tracking_uri(uri):  # mlflow.models reads the global store
            info = mlflow.models.get_model_info(f"models:/{model.model_id}")
        assert info.signature.inputs.to_dict() == [
            {"type": "tensor", "tensor-spec": {"dtype": "float32", "shape": (-1, 8)}}
        ]
        assert info.saved_input_example_info["type"] == "ndarray" and info.metadata["epoch"] == epoch

    # the alias: the kept checkpoint best by val_accuracy (the earliest of equals)
    best = max(kept_epochs, key=lambda epoch: (accuracy[epoch], -epoch))
    assert version.source == f"models:/{next(m.model_id for m in logged if m.name == f'checkpoint-{best}')}"

    # MLflow's pytorch flavor alone loads it: the exported program scales the raw features itself
    completed = subprocess.run(
        [sys.executable, "-c", LOAD_WITHOUT_THIS_REPO, uri, str(root / "four" / "valid" / "part.parquet")],
        capture_output=True,
        text=True,
        cwd=root,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert float(completed.stdout.split()[-1]) == pytest.approx(accuracy[best], abs=1e-9)

    # train.export: the best model's files load alone and match the eager MLP on 64 held-out rows
    checked, manifest = best_model_exports(client, run.info.run_id, root / "exports")
    assert set(checked) == {"torch_export", "onnx"} and all(within for _, within in checked.values()), checked
    assert manifest["input"] == {"column": FEATURES, "dtype": "float32", "shape": ["batch", 8]}
    assert manifest["checked"]["rows"] == 64 and manifest["outputs"]["task"] == "classification"
    assert len(manifest["scaling_inside"]["standardize"]["mean"]) == 8  # ingest.standardize: inside the files


def last_checkpoint(storage: Path) -> dict:
    return torch.load(sorted(storage.glob("checkpoint_*/checkpoint.pt"))[-1], weights_only=True)


def test_a_run_checkpoint_and_a_state_dict_file_give_the_same_start_with_a_fresh_head(pretrained):
    root, _ = pretrained
    client = MlflowClient(f"sqlite:///{root / 'outputs' / 'mlflow.db'}")
    version = client.get_model_version_by_alias("xor", "champion")
    storage = Path(client.get_run(version.run_id).data.tags["pipeline.storage"])
    checkpoint = sorted(storage.glob("checkpoint_*/checkpoint.pt"))[-1].parent
    starts = {}
    for weights in (str(checkpoint), str(checkpoint / "checkpoint.pt"), f"runs:/{version.run_id}/model"):
        cfg = table_config(root / "four", root / "outputs", 3, [f"finetune.weights={weights}"])
        starts[weights] = preflight.start_weights(cfg)
        assert starts[weights].fresh == ["6.bias", "6.weight"]  # 3 classes here, 4 there
        assert sorted(starts[weights].state) == ["0.bias", "0.weight", "3.bias", "3.weight"]
    last = torch.load(checkpoint / "checkpoint.pt", weights_only=True)["model"]
    assert torch.equal(starts[str(checkpoint)].state["3.weight"], last["3.weight"])


def test_torchvision_weights_without_network_fail_before_ray_starts_naming_the_file(tmp_path, data_root, monkeypatch):
    monkeypatch.setenv("PIPELINE_DATA_DIR", str(data_root))
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    monkeypatch.setenv("https_proxy", "http://127.0.0.1:9")  # offline, even where this machine is not
    monkeypatch.setattr(preflight.cluster, "connect", lambda wanted: pytest.fail("Ray started"))
    cfg = compose_cfg(["model=resnet18", "finetune.weights=IMAGENET1K_V1", f"paths.outputs={tmp_path}"])
    with pytest.raises(PipelineError) as raised:
        preflight.check(cfg)
    cached = tmp_path / "torch" / "hub" / "checkpoints" / "resnet18-f37072fd.pth"
    assert f"put it at {cached}" in str(raised.value)
    assert "Download https://download.pytorch.org/models/resnet18-f37072fd.pth" in str(raised.value)

    # with the file there, the weights load (here: a stand-in of the same shapes) and the head is swapped
    cached.parent.mkdir(parents=True, exist_ok=True)
    import torchvision

    torch.save(torchvision.models.resnet18().state_dict(), cached)
    initial = preflight.start_weights(cfg)
    assert initial.fresh == ["fc.bias", "fc.weight"] and "conv1.weight" in initial.state  # 10 classes, not 1000


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"weights": "/nowhere/weights.pt"}, "is neither a file nor a directory, an MLflow model URI"),
        ({"weights": "IMAGENET1K_V1"}, "is not a torchvision weight name of model._target_ torchvision.ops.MLP"),
        ({"weights": "models:/no-such-model@champion"}, "cannot read the MLflow model models:/no-such-model@champion"),
        ({"freeze": ["layer9.*"]}, "finetune.freeze: 'layer9.*' matches no parameter of the model"),
        ({"freeze": ["*"]}, "every parameter of the model is frozen"),
        ({"head": ["fc.*"]}, "finetune.head: ['fc.*'] matches no parameter"),
    ],
)
def test_weights_and_patterns_that_do_not_fit_fail_naming_the_key(tmp_path, settings, message):
    overrides = [f"finetune.{key}={value}" for key, value in settings.items()]
    cfg = compose_cfg(["+experiment=wine_mlp", f"paths.outputs={tmp_path}", *overrides])
    with pytest.raises(PipelineError) as raised:
        preflight.start_weights(cfg)
    assert message in str(raised.value)


def test_weights_of_another_model_fail_naming_the_parameters_that_differ(tmp_path):
    torch.save(torch.nn.Linear(13, 64).state_dict(), tmp_path / "linear.pt")
    cfg = compose_cfg(["+experiment=wine_mlp", f"finetune.weights={tmp_path / 'linear.pt'}"])
    with pytest.raises(PipelineError) as raised:
        preflight.start_weights(cfg)
    assert "weight is not in the model" in str(raised.value) and "0.weight is missing there" in str(raised.value)
    assert "Only the head (6.bias, 6.weight; finetune.head sets it) may differ" in str(raised.value)


def test_the_backbone_learns_at_its_scale_of_the_rate_the_optimizer_and_the_schedule_give():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    settings = FinetuneConfig(backbone_lr_scale=0.1)
    model[0].bias.requires_grad_(False)  # frozen (finetune.freeze, applied by build_model)
    groups = finetune.param_groups(model, settings)
    assert [len(g["params"]) for g in groups] == [2, 1]  # head: 2.weight, 2.bias; backbone: 0.weight (0.bias frozen)
    optimizer = torch.optim.AdamW(groups, lr=1.0)
    for group in optimizer.param_groups:
        group["lr"] *= group["lr_scale"]
    onecycle = {"_target_": "torch.optim.lr_scheduler.OneCycleLR", "max_lr": 0.5, "pct_start": 0.5}
    per_group = finetune.scaled_schedule(onecycle, optimizer)
    assert per_group == {"max_lr": [0.5, 0.05]}
    torch.optim.lr_scheduler.OneCycleLR(optimizer, total_steps=10, pct_start=0.5, **per_group)
    assert [g["max_lr"] for g in optimizer.param_groups] == [0.5, 0.05]
    assert finetune.scaled_schedule(onecycle, torch.optim.AdamW(finetune.param_groups(model, FinetuneConfig()))) == {}
