"""The pipeline on a real two-node Ray cluster (separate raylets on 127.0.0.1), driven from a separate
process as a user would: placement by resource and label, code shipped to the nodes, shared storage
required, and the predict stage's replicas pinned to the "GPU" node. Checked through Ray's state API."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import free_port
from mlflow import MlflowClient
from test_pipeline import no_runs_logged, run_cli

HERE = Path(__file__).parent
# Training on the "GPU" node by a custom resource and a label; every preprocessing step on the "CPU"
# node, by resource (decode, crop) or label (flip): what a user writes in an experiment file.
PLACEMENT = [
    "+scaling.resources_per_worker.gpu_node=1",
    "+scaling.label_selector.node-type=gpu",
    "+transforms.train.decode.resources.cpu_node=1",
    "+transforms.train.crop.resources.cpu_node=1",
    "+transforms.train.flip.label_selector.node-type=cpu",
    "+transforms.valid.decode.resources.cpu_node=1",
]


@pytest.fixture(scope="module")
def cluster():
    """Head ("CPU node", with the dashboard for the state API) + a "GPU node", in their own process."""
    helper = subprocess.Popen(
        [sys.executable, str(HERE / "two_node_cluster.py"), str(free_port())],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = helper.stdout.readline()
        assert line, f"the cluster did not start (exit {helper.poll()})"
        yield json.loads(line)
    finally:
        helper.stdin.close()  # the helper shuts the cluster down
        assert helper.wait(timeout=120) == 0


def state(cluster: dict):
    """Ray's state API on the cluster's dashboard: what ran where."""
    from ray.util.state import list_actors, list_tasks

    where = {cluster["cpu_node"]: "cpu", cluster["gpu_node"]: "gpu"}
    actors = list_actors(address=cluster["dashboard"], limit=10_000, detail=True, raise_on_missing_output=False)
    tasks = list_tasks(address=cluster["dashboard"], limit=10_000, detail=True, raise_on_missing_output=False)
    return [(a.class_name, where.get(a.node_id)) for a in actors], [(t.name, where.get(t.node_id)) for t in tasks]


@pytest.mark.slow
def test_multi_node_run_without_shared_storage_fails_before_anything_is_recorded(tmp_path, data_root, cluster):
    result = run_cli(["+experiment=smoke", f"ray.address={cluster['address']}"], tmp_path, data_root)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert "storage.path must be set on a cluster of 2 nodes" in output and "Traceback" not in output
    assert no_runs_logged(tmp_path)


@pytest.mark.slow
def test_smoke_trains_on_the_gpu_node_preprocesses_on_the_cpu_node_and_predicts(tmp_path, data_root, cluster):
    storage = tmp_path / "storage"
    result = run_cli(
        [
            "+experiment=smoke",
            f"ray.address={cluster['address']}",
            f"storage.path={storage}",
            "tracking.run_name=on-cluster",
            "hydra.run.dir=run",
            *PLACEMENT,
        ],
        tmp_path,
        data_root,
    )
    assert result.returncode == 0, result.stdout + result.stderr

    client = MlflowClient(f"sqlite:///{tmp_path / 'outputs' / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("smoke").experiment_id])
    assert run.info.status == "FINISHED" and 0 <= run.data.metrics["val_accuracy"] <= 1
    assert run.data.tags["pipeline.storage"].startswith(str(storage))
    ranks = [json.loads(line) for line in (tmp_path / "run" / "workers.jsonl").read_text().splitlines()]
    assert sorted(r["rank"] for r in ranks) == [0, 1]
    assert {r["node_id"] for r in ranks} == {cluster["gpu_node"]}
    # the workers imported the pipeline the driver uploaded (ray.py_modules), not this checkout
    assert all("runtime_resources" in r["code"] and not r["code"].startswith(str(HERE.parent)) for r in ranks)

    actors, tasks = state(cluster)
    assert Counter(node for name, node in actors if name == "RayTrainWorker") == {"gpu": 2}
    # the cache's decode tasks (a task per row group) and each epoch's crop + flip, all where the steps asked
    for step in ("build_pieces", "cached"):
        nodes = {node for name, node in tasks if step in name}
        assert nodes == {"cpu"}, (step, nodes)

    result = run_cli(
        [
            "+experiment=smoke",
            "stage=predict",
            "predict.run=on-cluster",
            f"ray.address={cluster['address']}",
            f"predict.output={tmp_path / 'predictions'}",
            "predict.num_cpus=0",
            "+predict.resources.gpu_node=1",
            "+transforms.valid.decode.resources.cpu_node=1",
        ],
        tmp_path,
        data_root,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    actors, tasks = state(cluster)
    assert {node for name, node in actors if "Predictor" in name} == {"gpu"}
    predicted = client.search_runs(
        [client.get_experiment_by_name("smoke").experiment_id], filter_string="tags.`pipeline.stage` = 'predict'"
    )[0]
    table = pq.read_table(tmp_path / "predictions")
    assert table.num_rows == predicted.data.metrics["predict_rows"] == run.data.metrics["val_rows"]
    assert predicted.data.metrics["predict_accuracy"] == pytest.approx(run.data.metrics["val_accuracy"], abs=0.01)


@pytest.mark.slow
def test_a_tune_sweep_runs_its_trials_on_both_nodes(tmp_path, cluster):
    """Two trials at once, each worker taking the one ``trial_slot`` a node has: one trial per node,
    recorded in MLflow by the driver (the tag is rank 0's node, from the trial's reports)."""
    result = run_cli(
        [
            "-m",
            "+experiment=wine_mlp",
            "hparams_search=tune",
            "hydra/sweeper/scheduler=fifo",
            "optim.lr=3e-3,1e-2",
            "hydra.sweeper.num_samples=1",
            "hydra.sweeper.max_concurrent_trials=2",
            "train.epochs=2",
            f"ray.address={cluster['address']}",
            f"storage.path={tmp_path / 'storage'}",
            "scaling.resources_per_worker.CPU=0.5",
            "+scaling.resources_per_worker.trial_slot=1",
            "hydra.sweep.dir=sweep",
        ],
        tmp_path,
        tmp_path / "data",
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    client = MlflowClient(f"sqlite:///{tmp_path / 'outputs' / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("wine_mlp").experiment_id])
    trials = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert len(trials) == 2 and all(t.info.status == "FINISHED" for t in trials)
    assert {t.data.tags["pipeline.node_id"] for t in trials} == {cluster["cpu_node"], cluster["gpu_node"]}
    assert all(t.data.tags["pipeline.storage"].startswith(str(tmp_path / "storage")) for t in trials)


@pytest.mark.slow
def test_real_size_photos_are_cropped_on_the_cpu_only_node_while_training_runs_on_the_other(tmp_path, cluster):
    """The training worker takes every CPU of the "GPU" node, and no step is pinned: the random-resized-crop
    (+ flip) tasks of every epoch go where CPUs are free, to the CPU-only node, reading the cache of
    decoded photos (built while the trainer starts, wherever CPUs were free then). Photos of 256-512
    pixels a side (source=photos, written offline), cropped to 64 here to keep the model small."""
    before = Counter((name, node) for name, node in state(cluster)[1])  # what earlier tests ran on this cluster
    result = run_cli(
        [
            "+experiment=photos_resnet",
            "scaling=cpu",
            "scaling.num_workers=1",
            "scaling.resources_per_worker.CPU=2",
            "+scaling.resources_per_worker.gpu_node=1",
            "source.download.rows=96",
            "train.epochs=1",
            "ingest.batch_size=32",
            "transforms.train.crop.fn.size=64",
            "transforms.valid.decode.fn.size=64",
            "transforms.valid.decode.fn.resize=73",
            f"ray.address={cluster['address']}",
            f"storage.path={tmp_path / 'storage'}",
            "hydra.run.dir=run",
        ],
        tmp_path,
        tmp_path / "data",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    client = MlflowClient(f"sqlite:///{tmp_path / 'outputs' / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("photos_resnet").experiment_id])
    assert run.info.status == "FINISHED" and run.data.metrics["train_rows"] == 96
    (worker,) = [json.loads(line) for line in (tmp_path / "run" / "workers.jsonl").read_text().splitlines()]
    assert worker["node_id"] == cluster["gpu_node"]
    tasks = Counter((name, node) for name, node in state(cluster)[1]) - before  # this run's
    crops = Counter(node for (name, node), count in tasks.items() for _ in range(count) if "cached" in name)
    assert set(crops) == {"cpu"}, crops  # the per-epoch steps run in the "cached" tasks
    assert sum(count for (name, _), count in tasks.items() if "build_pieces" in name) == 16 + 9  # one per row group
