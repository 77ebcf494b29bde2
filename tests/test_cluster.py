"""The pipeline on a real two-node Ray cluster (separate raylets on 127.0.0.1), driven from a separate
process as a user would: placement by resource and label, code shipped to the nodes, shared storage
required, and the predict stage's replicas pinned to the "GPU" node. Checked through Ray's state API."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from contextlib import contextmanager
from itertools import combinations
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import WIDE, free_port
from exported import best_model_exports
from mlflow import MlflowClient
from test_fault_tolerance import assert_each_epoch_once
from test_pipeline import cli_env, no_runs_logged, run_cli
from test_preemption import (
    BATCH,
    TRAIN_ROWS,
    assert_each_row_once,
    epochs_of,
    finish,
    start,
    the_run,
    wait_for_step,
    workers,
)
from test_tune import epochs_logged, sweep_runs

from pipeline.training import preemption

HERE = Path(__file__).parent
# Photos of 256-512 pixels a side (source=photos, written offline: 100 training rows in 15 files, 10
# validation rows in 10, so two workers split validation evenly), cropped to 64 to keep the model small.
SMALL_PHOTOS = [
    "+experiment=photos_resnet",
    "scaling=cpu",
    "source.download.rows=100",
    "transforms.train.crop.fn.size=64",
    "transforms.valid.decode.fn.size=64",
    "transforms.valid.decode.fn.resize=73",
]
# What a user writes in an experiment file: training on the "GPU" node by a custom resource and a label,
# the decode steps on the "CPU" node by resource (training's) or label (validation's).
START_TRIES = 3
PLACEMENT = [
    "+scaling.resources_per_worker.gpu_node=1",
    "+scaling.label_selector.node-type=gpu",
    "+transforms.train.decode.resources.cpu_node=1",
    "+transforms.valid.decode.label_selector.node-type=cpu",
]


@contextmanager
def local_cluster(layout: str):
    """A cluster of ``layout`` (tests/local_cluster.py) in its own process, with the dashboard for the state API; its
    workers import tests/ modules (the ledger model) as a cluster's image would hold a user's code. A start that
    fails is tried again on another port, up to ``START_TRIES`` times: the dashboard's port, free when picked, was
    once taken by another process before the head bound it (4 tests lost to one port in a full suite)."""
    for _ in range(START_TRIES):
        helper = subprocess.Popen(
            [sys.executable, str(HERE / "local_cluster.py"), layout, str(free_port())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(HERE)},  # the nodes' workers import the ledger model and its step
        )
        line = helper.stdout.readline()
        if line:
            break
        helper.wait(timeout=120)  # its traceback is in the test's captured stderr
    assert line, f"the cluster did not start in {START_TRIES} tries (exit {helper.poll()})"
    try:
        yield {**json.loads(line), "helper": helper}
    finally:
        helper.stdin.close()  # the helper shuts the cluster down
        assert helper.wait(timeout=120) == 0


@pytest.fixture(scope="module")
def cluster():
    """Head ("CPU node") + a "GPU node"."""
    with local_cluster("two-node") as running:
        yield running


@pytest.fixture(scope="module")
def preprocessing_cluster():
    """A training head + two CPU-only preprocessing nodes, each with a 100 MB object store."""
    with local_cluster("preprocessing") as running:
        yield running


def node_command(cluster: dict, command: str) -> dict:
    """Have the cluster's helper ``add`` its third node (one ``elastic_slot``) or ``remove`` it; its answer."""
    helper = cluster["helper"]
    helper.stdin.write(command + "\n")
    helper.stdin.flush()
    return json.loads(helper.stdout.readline())


def state(cluster: dict):
    """Ray's state API on the cluster's dashboard: how many of each actor and task ran on which node."""
    from ray.util.state import list_actors, list_tasks

    where = {cluster["cpu_node"]: "cpu", cluster["gpu_node"]: "gpu"}
    actors = list_actors(address=cluster["dashboard"], limit=10_000, detail=True, raise_on_missing_output=False)
    tasks = list_tasks(address=cluster["dashboard"], limit=10_000, detail=True, raise_on_missing_output=False)
    return Counter((a.class_name, where.get(a.node_id)) for a in actors), Counter(
        (t.name, where.get(t.node_id)) for t in tasks
    )


def since(before: tuple, after: tuple) -> tuple[dict[str, Counter], dict[str, Counter]]:
    """The actors and tasks that ran between two :func:`state` calls, by name (actor class, or a task's
    name holding ``build_pieces`` / ``ReadEpochSource``), each as a count per node."""

    def grouped(old: Counter, new: Counter, names: tuple[str, ...] | None) -> dict[str, Counter]:
        found: dict[str, Counter] = {}
        for (name, node), count in (new - old).items():
            key = name if names is None else next((n for n in names if n in name), None)
            if key is not None:
                found.setdefault(key, Counter())[node] += count
        return found

    return grouped(before[0], after[0], None), grouped(before[1], after[1], ("build_pieces", "ReadEpochSource"))


@pytest.mark.slow
def test_multi_node_run_without_shared_storage_fails_before_anything_is_recorded(tmp_path, data_root, cluster):
    result = run_cli(["+experiment=smoke", f"ray.address={cluster['address']}"], tmp_path, data_root)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert "storage.path must be set on a cluster of 2 nodes" in output and "Traceback" not in output
    assert no_runs_logged(tmp_path)


@pytest.mark.slow
def test_photos_train_on_the_gpu_node_are_cropped_on_the_cpu_node_and_predicted_on_the_gpu_node(tmp_path, cluster):
    """Two training workers take every CPU of the "GPU" node. The decode steps are pinned to the "CPU"
    node; the per-epoch random-resized-crop (+ flip) is not: its tasks go where CPUs are free, to the
    CPU-only node, reading the cache of decoded photos. The predict stage's replicas are pinned to the
    "GPU" node and score the same rows as validation."""
    before = state(cluster)  # what earlier tests ran on this cluster
    storage = tmp_path / "storage"
    result = run_cli(
        [
            *SMALL_PHOTOS,
            *PLACEMENT,
            "scaling.num_workers=2",
            "scaling.resources_per_worker.CPU=1",
            "train.epochs=1",
            "ingest.cache=true",  # one epoch reads each row once: auto would stream it
            "ingest.batch_size=32",
            f"ray.address={cluster['address']}",
            f"storage.path={storage}",
            "tracking.run_name=on-cluster",
            "train.export=[torch_export,onnx]",
            "hydra.run.dir=run",
        ],
        tmp_path,
        tmp_path / "data",
    )
    assert result.returncode == 0, result.stdout + result.stderr

    client = MlflowClient(f"sqlite:///{tmp_path / 'outputs' / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("photos_resnet").experiment_id])
    assert run.info.status == "FINISHED" and run.data.metrics["train_rows"] == 100
    (report,) = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert run.data.metrics["val_accuracy"] == report["ranks"][0]["val_accuracy"]  # what rank 0 reported
    assert run.data.tags["pipeline.storage"].startswith(str(storage))
    ranks = [json.loads(line) for line in (tmp_path / "run" / "workers.jsonl").read_text().splitlines()]
    assert sorted(r["rank"] for r in ranks) == [0, 1]
    assert {r["node_id"] for r in ranks} == {cluster["gpu_node"]}
    # the workers imported the pipeline the driver uploaded (ray.py_modules), not this checkout
    assert all("runtime_resources" in r["code"] and not r["code"].startswith(str(HERE.parent)) for r in ranks)
    # the trained ResNet's exports load without this repo and match it on rank 0's validation photos
    checked, manifest = best_model_exports(client, run.info.run_id, tmp_path / "exports")
    assert set(checked) == {"torch_export", "onnx"} and all(within for _, within in checked.values()), checked
    assert manifest["input"]["shape"] == ["batch", 3, 64, 64] and manifest["checked"]["rows"] > 0

    actors, tasks = since(before, state(cluster))  # this run's
    assert actors["RayTrainWorker"] == Counter({"gpu": 2})
    # the cache's decode tasks (one per row group), pinned; each epoch's read of the cache with its crop + flip (Ray
    # Data's read tasks, the steps fused in), not pinned
    assert sum(tasks["build_pieces"].values()) == 15 + 10 and set(tasks["build_pieces"]) == {"cpu"}
    assert tasks["ReadEpochSource"] and set(tasks["ReadEpochSource"]) == {"cpu"}, tasks["ReadEpochSource"]

    before = state(cluster)
    result = run_cli(
        [
            *SMALL_PHOTOS,
            "stage=predict",
            "predict.run=on-cluster",
            f"ray.address={cluster['address']}",
            f"predict.output={tmp_path / 'predictions'}",
            "predict.num_cpus=0",
            "+predict.resources.gpu_node=1",
            "+transforms.valid.decode.label_selector.node-type=cpu",
        ],
        tmp_path,
        tmp_path / "data",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    actors, _ = since(before, state(cluster))
    assert {node for name, nodes in actors.items() if "Predictor" in name for node in nodes} == {"gpu"}
    predicted = client.search_runs(
        [client.get_experiment_by_name("photos_resnet").experiment_id],
        filter_string="tags.`pipeline.stage` = 'predict'",
    )[0]
    table = pq.read_table(tmp_path / "predictions")
    assert table.num_rows == predicted.data.metrics["predict_rows"] == run.data.metrics["val_rows"]
    assert predicted.data.metrics["predict_accuracy"] == pytest.approx(run.data.metrics["val_accuracy"], abs=0.01)


@pytest.mark.slow
def test_a_tune_sweep_runs_two_trials_at_once_one_per_node_and_the_scheduler_stops_the_bad_one(tmp_path, cluster):
    """Three trials of tiny MLPs on scikit-learn's wine data (written offline on first use), at most two at
    once, each worker taking the one ``trial_slot`` a node has: one trial per node. lr=0, the clearly bad
    one, is listed last so that ASHA has the others' results when it reaches its first rung. MLflow is
    written by the driver only (the node tag is rank 0's node, from the trial's reports)."""
    result = run_cli(
        [
            "-m",
            "+experiment=wine_mlp",
            "hparams_search=tune",
            "optim.lr=3e-3,1e-2,0",
            "hydra.sweeper.num_samples=1",
            "hydra.sweeper.max_concurrent_trials=2",
            "train.epochs=4",
            f"ray.address={cluster['address']}",
            f"storage.path={tmp_path / 'storage'}",
            "scaling.resources_per_worker.CPU=0.5",
            "+scaling.resources_per_worker.trial_slot=1",
            "tracking.register_as=wine",  # every trial's best checkpoint a version; champion: the best trial's
            "train.checkpoint_metric=val_accuracy",
            "train.num_to_keep=1",  # each trial's best checkpoint and its latest
            "hydra.sweep.dir=sweep",
        ],
        tmp_path,
        tmp_path / "data",
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "3 jobs, 0 failed" in output and "Traceback" not in output
    client, parent, children = sweep_runs(tmp_path)
    assert len(children) == 3 and len({c.data.tags["pipeline.tune_trial_id"] for c in children}) == 3
    assert sorted(float(c.data.params["optim.lr"]) for c in children) == [0, 3e-3, 1e-2]
    assert {c.data.tags["pipeline.node_id"] for c in children} == {cluster["cpu_node"], cluster["gpu_node"]}
    assert all(c.data.tags["pipeline.storage"].startswith(str(tmp_path / "storage")) for c in children)

    # the runs' own recorded windows: some overlap, never more than two at once
    windows = [(c.info.start_time, c.info.end_time) for c in children]
    assert any(a[0] < b[1] and b[0] < a[1] for a, b in combinations(windows, 2))
    assert all(sum(s <= start < e for s, e in windows) <= 2 for start, _ in windows)

    (bad,) = [c for c in children if float(c.data.params["optim.lr"]) == 0]
    assert bad.info.status == "FINISHED" and "by ASHAScheduler" in bad.data.tags["pipeline.stopped_early"]
    assert epochs_logged(client, bad) == list(range(len(epochs_logged(client, bad))))
    assert len(epochs_logged(client, bad)) < 4  # stopped before its last epoch, its metrics kept
    assert "STOPPED" in output

    best = max(children, key=lambda c: c.data.metrics["val_accuracy"])
    assert best.data.metrics["val_accuracy"] > 0.8 and "pipeline.stopped_early" not in best.data.tags
    assert parent.data.tags["pipeline.best_run_id"] == best.info.run_id and parent.info.status == "FINISHED"
    assert {"config.yaml", "model", "learning_curve.png"} <= {a.path for a in client.list_artifacts(best.info.run_id)}
    champion = client.get_model_version_by_alias("wine", "champion")
    assert champion.run_id == best.info.run_id
    accuracy = {m.step: m.value for m in client.get_metric_history(best.info.run_id, "val_accuracy")}
    logged = client.search_logged_models([best.info.experiment_id], f"source_run_id = '{best.info.run_id}'")
    epoch_of = {m.model_id: int(m.tags["pipeline.epoch"]) for m in logged}
    kept = sorted(epoch_of.values())  # a LoggedModel per kept checkpoint: the best and the latest
    assert kept[-1] == max(accuracy) and len(kept) <= 2
    assert accuracy[epoch_of[champion.source.removeprefix("models:/")]] == max(accuracy.values())  # its best, not last
    assert len(client.search_model_versions("name = 'wine'")) == 3
    trial = best.data.tags["pipeline.tune_trial_id"]
    assert (tmp_path / "sweep" / trial / "metrics.jsonl").exists()


def workers_per_epoch(run_dir: Path) -> list[int]:
    """The worker group's size each reported epoch ran on (the run's metrics.jsonl, so far)."""
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [int(json.loads(line)["ranks"][0]["workers"]) for line in lines]


def wait_for_workers(run_dir: Path, reached, timeout_s: float = 240.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while not reached(sizes := workers_per_epoch(run_dir)):
        assert time.monotonic() < deadline, f"workers per epoch so far: {sizes}"
        time.sleep(0.2)
    return sizes


@pytest.mark.slow
def test_elastic_workers_grow_when_a_node_joins_and_shrink_when_it_leaves(tmp_path, cluster):
    """scaling.num_workers=[1, 2], each worker taking an ``elastic_slot``: the run starts with the GPU node's
    one, grows to two workers when a third node joins, and shrinks back when that node leaves, each time
    from the latest checkpoint; every epoch logged once, with the worker count it ran on. Before it leaves, the
    node is drained as a spot reclaim's notice drains it (``ray drain-node``, reason preemption): the workers
    checkpoint at the step they are on, the run's only checkpoint within an epoch but the stop's
    (``train.checkpoint_every=null`` here). Once two epochs have run on one worker again, the command is stopped
    (SIGTERM): the run's epochs left would show nothing more."""
    command = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pipeline",
            "+experiment=wine_mlp",
            "scaling.num_workers=[1,2]",
            "scaling.elastic_resize_monitor_interval_s=1",
            "+scaling.resources_per_worker.elastic_slot=1",
            "train.max_failures=2",  # the node that leaves takes a worker with it: a failure to Ray Train
            "train.checkpoint_every=null",  # no checkpoint within an epoch but the drain's
            "train.num_to_keep=null",  # each kept
            # more than the grow, which a node starting on a busy machine can hold up for 10 epochs and more, and
            # the drain take (Ray Train's watcher polls every 5 s, the workers ask it every 5 s): stopped before
            "train.epochs=200",
            "tracking.log_model=false",
            f"ray.address={cluster['address']}",
            f"storage.path={tmp_path / 'storage'}",
            "hydra.run.dir=run",
        ],
        cwd=tmp_path,
        # a worker group too big for what is left after a node leaves: Ray Train retries smaller after this
        env={**cli_env(tmp_path / "data"), "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "10"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    said = Output(command)
    try:
        wait_for_workers(tmp_path / "run", lambda sizes: sizes[-1:] == [1])
        added = node_command(cluster, "add")["added"]
        wait_for_workers(tmp_path / "run", lambda sizes: sizes[-1:] == [2])
        drain = ["ray", "drain-node", "--address", cluster["address"], "--node-id", added]
        reason = ["--reason", "DRAIN_NODE_REASON_PREEMPTION", "--reason-message", "spot reclaim"]
        subprocess.run([*drain, *reason, "--deadline-remaining-seconds", "300"], check=True, capture_output=True)
        deadline = time.monotonic() + 120
        while not (drained := drain_checkpoints(tmp_path / "storage", added)):
            assert time.monotonic() < deadline, said.text[-3000:]
            time.sleep(0.2)
        node_command(cluster, "remove")
        wait_for_workers(tmp_path / "run", lambda sizes: phases_of(sizes) == [1, 2, 1] and sizes[-2:] == [1, 1])
        command.send_signal(signal.SIGTERM)
        command.wait(timeout=120)
        said.join(timeout=10)
        output = said.text
    finally:
        command.kill()
    assert command.returncode == 143 and "Traceback" not in output, output[-3000:]  # stopped: 128 + SIGTERM
    assert "on 2 workers" in output and "on 1 worker\n" in output  # the console says each resize

    client = MlflowClient(f"sqlite:///{tmp_path / 'outputs' / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("wine_mlp").experiment_id])
    assert run.info.status == "KILLED" and run.data.metrics["val_accuracy"] > 0.8
    history = sorted(client.get_metric_history(run.info.run_id, "workers"), key=lambda m: m.step)
    sizes = [int(m.value) for m in history]  # with the epochs whose reports the stop overtook, from checkpoints
    heard = workers_per_epoch(tmp_path / "run")
    assert phases_of(sizes) == [1, 2, 1] and sizes[: len(heard)] == heard and len(sizes) < 200, (sizes, heard)
    assert len(client.get_metric_history(run.info.run_id, "restores")) == 2  # grown, then shrunk
    within = [json.loads(path.read_text()) for path in (tmp_path / "storage").glob("*/checkpoint_*/report.json")]
    within = [r for r in within if "epoch_step" in r and r.get("why") != preemption.STOPPING]
    assert within == drained  # the only checkpoint within an epoch but the stop's: the drain's
    assert_each_epoch_once(client, run.info.run_id, len(sizes))
    ranks = [json.loads(line) for line in (tmp_path / "run" / "workers.jsonl").read_text().splitlines()]
    assert {r["node_id"] for r in ranks} == {cluster["gpu_node"], added}  # only the nodes with an elastic_slot


def phases_of(sizes: list[int]) -> list[int]:
    """The worker counts a run went through, in order: [1, 2, 1] for a grow and a shrink."""
    return [size for i, size in enumerate(sizes) if i == 0 or sizes[i - 1] != size]


def drain_checkpoints(storage: Path, node: str) -> list[dict]:
    """The reports of the checkpoints within an epoch in ``storage`` taken because ``node`` was draining."""
    reports = [json.loads(path.read_text()) for path in storage.glob("*/checkpoint_*/report.json")]
    return [report for report in reports if f"node(s) {node} draining" in report.get("why", "")]


class Output(threading.Thread):
    """A process's output, read as it comes."""

    def __init__(self, process: subprocess.Popen) -> None:
        super().__init__(daemon=True)
        self.fd, self.text = process.stdout.fileno(), ""
        self.start()

    def run(self) -> None:
        while chunk := os.read(self.fd, 65536):
            self.text += chunk.decode(errors="replace")


@pytest.mark.slow
def test_a_preprocessing_node_lost_mid_epoch_costs_a_re_read_and_each_row_trains_once_an_epoch(
    tmp_path, ledger_data, preprocessing_cluster
):
    """Three nodes: training on the head, the reads and a step pinned to two CPU-only nodes by label, as a user writes
    it; the training split streamed and shuffled by Ray Data's read tasks, 2 epochs. One preprocessing node is lost
    in the middle of epoch 1 (a fifth of its steps trained, the node's blocks not yet trained on) and another joins.
    The run finishes; the model's own ledger shows each row of each epoch trained on once; Ray ran the lost node's
    read tasks again (more read tasks than the epochs plan); the splits were never read on the head, the joined node
    reads; nothing spills."""
    address = preprocessing_cluster["address"]
    pinned = ["transforms=pinned_pass", f"hydra.searchpath=[file://{HERE / 'conf'}]"]  # tests/conf/transforms
    run = start(
        tmp_path,
        ledger_data,
        *pinned,
        "ingest.cache=false",
        "ingest.shuffle=true",
        # no shuffle buffer: the split stays on the nodes that read it until it trains, as a split larger than the
        # buffers does (the default buffer pulls this small one to the head before the first step)
        "ingest.local_shuffle_buffer_size=null",
        "model.delay_s=0.2",
        "+scaling.label_selector.node-type=train",
        "scaling.num_workers=1",
        f"ray.address={address}",
        f"storage.path={tmp_path / 'storage'}",
        features=("wide", WIDE),  # blocks of 160 KB: in the object store of the node that read them
    )
    try:
        (worker,) = workers(tmp_path, 1)
        wait_for_step(tmp_path, worker["pid"], TRAIN_ROWS // BATCH // 5, timeout_s=300)
        lost = node_command(preprocessing_cluster, "lose")["removed"]
        joined = node_command(preprocessing_cluster, "add")["added"]
        output = finish(run)
    finally:
        run.kill()
    client, finished = the_run(tmp_path)
    assert finished.info.status == "FINISHED", output[-3000:]
    assert_each_row_once(epochs_of(worker["pid"], tmp_path), epochs=2)
    reads = finished.data.tags["pipeline.reads"]
    shares = {node: int(share) / 100 for node, share in re.findall(r"(\w{8}) (\d+)%", reads)}
    cpu_nodes = {preprocessing_cluster[name][:8] for name in ("cpu_node_0", "cpu_node_1")} | {joined[:8]}
    assert lost == preprocessing_cluster["cpu_node_1"] and set(shares) <= cpu_nodes and joined[:8] in shares, reads
    assert re.search(r"; [1-9]\d* read task\(s\) run again \(what a lost node held\)", reads), reads
    memory = subprocess.run(["ray", "memory", "--stats-only", "--address", address], capture_output=True, text=True)
    assert memory.returncode == 0 and "Spilled" not in memory.stdout, memory.stdout
