"""The predict stage's parts: which run it takes, how weights load, where predictions may go, and
the replica's output against the model's own (end to end: test_pipeline.py, test_cluster.py)."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest
import ray
import torch
from conftest import compose_cfg
from hydra.utils import instantiate
from mlflow import MlflowClient
from test_pipeline import run_cli

from pipeline.common.errors import PipelineError
from pipeline.data import datasets
from pipeline.jobs import preflight
from pipeline.jobs.predict import Predictor, check_output, load_weights, prediction_split, trained_run
from pipeline.tracking import lineage, mlflow_store, models
from pipeline.training.checkpoint import CHECKPOINT_FILE


@pytest.fixture
def store(tmp_path):
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    return client, client.create_experiment("e", artifact_location=(tmp_path / "artifacts").as_uri())


def test_the_model_run_is_named_by_id_or_name_or_is_the_newest_finished_training_run(store):
    client, experiment = store
    ids = {}
    for name, status, trained in [
        ("old", "FINISHED", True),
        ("new", "FINISHED", True),
        ("died", "FAILED", True),
        ("sweep parent", "FINISHED", False),
    ]:
        tags = {mlflow_store.STORAGE_TAG: f"/ckpt/{name}"} if trained else {}
        ids[name] = client.create_run(experiment, run_name=name, tags=tags).info.run_id
        client.set_terminated(ids[name], status)
    assert trained_run(client, experiment, None).info.run_id == ids["new"]
    assert trained_run(client, experiment, "old").info.run_id == ids["old"]
    assert trained_run(client, experiment, ids["died"]).info.run_id == ids["died"]
    with pytest.raises(PipelineError, match="predict.run: no run with the id or name 'nope'"):
        trained_run(client, experiment, "nope")
    empty = client.create_experiment("empty")
    with pytest.raises(PipelineError, match="no finished training run"):
        trained_run(client, empty, None)


def test_weights_load_only_as_weights_from_checkpoints_state_dicts_and_logged_models(tmp_path, store):
    client, experiment = store
    weights = {"w": torch.arange(4.0)}
    (tmp_path / "ckpt").mkdir()
    torch.save({"model": weights, "optimizer": {}, "epoch": 3}, tmp_path / "ckpt" / CHECKPOINT_FILE)
    torch.save(weights, tmp_path / "bare.pt")
    for weights_file in (tmp_path / "ckpt", tmp_path / "ckpt" / CHECKPOINT_FILE, tmp_path / "bare.pt"):
        loaded, statistics = load_weights(client, None, str(weights_file))
        assert torch.equal(loaded["w"], weights["w"]) and statistics is None
    standardized = {"mean": [1.0, 2.0], "std": [3.0, 4.0]}  # a checkpoint of a run with ingest.standardize
    torch.save({"model": weights, "optimizer": {}, "feature_statistics": standardized}, tmp_path / "std.pt")
    assert load_weights(client, None, str(tmp_path / "std.pt"))[1] == standardized
    torch.save({"model": weights, "code": np.dtype("O")}, tmp_path / "pickled.pt")  # not plain weights
    with pytest.raises(PipelineError, match="cannot load .*pickled.pt as weights"):
        load_weights(client, None, str(tmp_path / "pickled.pt"))

    run_id = client.create_run(experiment, run_name="r").info.run_id
    with pytest.raises(PipelineError, match="has no model/state_dict.pt .* predict.checkpoint=PATH"):
        load_weights(client, client.get_run(run_id), None)
    models.log_model(client, run_id, str(tmp_path / "ckpt"))
    loaded, statistics = load_weights(client, client.get_run(run_id), None)
    assert torch.equal(loaded["w"], weights["w"]) and statistics is None
    client.log_dict(run_id, standardized, lineage.STATISTICS_ARTIFACT)  # as a standardized run logs them
    assert load_weights(client, client.get_run(run_id), None)[1] == standardized


def test_predictions_go_to_a_new_or_empty_directory(tmp_path):
    check_output(str(tmp_path / "new"), {})
    assert (tmp_path / "new").is_dir()
    check_output(str(tmp_path / "new"), {})  # still empty: fine
    (tmp_path / "new" / "part-0.parquet").write_bytes(b"old")
    with pytest.raises(PipelineError, match="predict.output: .* already holds files"):
        check_output(str(tmp_path / "new"), {})


def test_a_replica_predicts_what_the_model_does_on_normalized_pixels(ray_runtime):
    cfg = compose_cfg(["+experiment=smoke"])
    torch.manual_seed(0)
    model = instantiate(cfg.model, _convert_="all").eval()
    pixels = np.random.default_rng(0).integers(0, 256, (8, 3, 32, 32), dtype=np.uint8)
    predictor = Predictor(
        model_cfg=cfg.model,
        task_cfg=cfg.task,
        weights=[ray.put(model.state_dict())],
        normalize=cfg.ingest.normalize,
        statistics=None,
        feature="image",
        label="label",
        use_gpu=False,
        train_cfg=cfg.train,
    )
    out = predictor({"image": pixels, "label": np.arange(8), "path": np.array(["f.parquet"] * 8)})
    with torch.no_grad():
        logits = model(torch.as_tensor(pixels).float() / 255 * 2 - 1)  # mean 0.5, std 0.5
    np.testing.assert_array_equal(out["prediction"], logits.argmax(1).numpy())
    np.testing.assert_allclose(out["confidence"], torch.softmax(logits, 1).max(1).values.numpy(), rtol=1e-5)
    np.testing.assert_array_equal(out["label"], np.arange(8))
    assert list(out["path"]) == ["f.parquet"] * 8


def test_predict_without_a_trained_run_says_what_to_do(tmp_path, data_root):
    result = run_cli(["+experiment=smoke", "stage=predict"], tmp_path, data_root)
    output = result.stdout + result.stderr
    assert result.returncode == 1 and "Traceback" not in output
    assert "predict: there is no MLflow experiment 'smoke'" in output and "predict.checkpoint=PATH" in output


def test_evaluation_scores_source_test_when_given_and_a_test_split_without_labels_fails_before_training(tmp_path):
    """predict.source, else source.test, else source.valid; train.evaluate checks the rows it will score
    before the run starts (here before Ray would)."""
    datasets.write_sklearn(str(tmp_path), "wine")
    wine = tmp_path / "wine"
    rows = pq.read_table(wine / "valid")
    (wine / "test").mkdir()
    pq.write_table(rows.slice(0, 20).drop(["target"]), wine / "test" / "part.parquet")
    base = ["+experiment=wine_mlp", f"source.root={tmp_path}"]
    key, split, label = prediction_split(compose_cfg(base), evaluating=True)
    assert (key, split.rows, label) == ("source.valid", rows.num_rows, "target")
    key, split, label = prediction_split(compose_cfg([*base, f"source.test={wine / 'test'}"]), evaluating=False)
    assert (key, split.rows, label) == ("source.test", 20, None)
    given = [*base, f"source.test={wine / 'test'}", f"predict.source={wine / 'valid'}"]
    assert prediction_split(compose_cfg(given), evaluating=True)[0] == "predict.source"
    with pytest.raises(PipelineError, match=r"stage=evaluate .* but source.test .*/test has no column 'target'"):
        preflight.check(compose_cfg([*base, f"source.test={wine / 'test'}", "train.evaluate=true"]))
