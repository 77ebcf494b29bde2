"""Failures with real processes and signals: a killed training worker, Ctrl-C swallowed where it landed.
(SIGTERM on the command and resuming the interrupted run into the same MLflow run: the S3 run in
test_s3.py, which is interrupted and resumed.)"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
import torch
from conftest import DETERMINISTIC, alive, compose_cfg, descendants, in_process
from mlflow import MlflowClient
from test_pipeline import cli_env

from pipeline.api import compose
from pipeline.common.errors import PipelineError
from pipeline.common.metrics import epoch_metrics
from pipeline.jobs.job import Job
from pipeline.jobs.train import run


def assert_all_gone(started: list[psutil.Process]) -> None:
    """Every process the command started has exited (within 30 s of the command itself; Ray's agents, which
    linger a minute without workarounds.end_agents_at_exit, included)."""
    deadline = time.monotonic() + 30
    while alive(started) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert started and alive(started) == {}  # Ray's raylet, GCS and every worker went with the driver


def wait_for_epochs(run_dir: Path, count: int, timeout_s: float = 300.0) -> None:
    """Block until the job's metrics.jsonl holds ``count`` reported epochs."""
    path, deadline = run_dir / "metrics.jsonl", time.monotonic() + timeout_s
    while not (path.exists() and len(path.read_text().splitlines()) >= count):
        assert time.monotonic() < deadline, f"no {count} epoch(s) reported in {run_dir}"
        time.sleep(0.05)


def start_cli(args: list[str], cwd: Path, data_root: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "pipeline", *args],
        cwd=cwd,
        env=cli_env(data_root),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def stop_after_first_epoch(
    tmp_path: Path, data_root: Path, args: list[str], stop: Callable[[subprocess.Popen, list[psutil.Process]], None]
) -> tuple[str, list[psutil.Process]]:
    """Start the command, ``stop(command, its processes)`` once epoch 1 is reported (epoch 2 is under way),
    and return its output and the processes it had started; it must exit non-zero."""
    process = start_cli([*args, "hydra.run.dir=run"], tmp_path, data_root)
    try:
        wait_for_epochs(tmp_path / "run", 1)
    except BaseException:  # the command and its Ray must not outlive a failed test
        for child in [*descendants(process.pid), psutil.Process(process.pid)]:
            with contextlib.suppress(psutil.Error):
                child.kill()
        process.communicate()
        raise
    started = descendants(process.pid)
    stop(process, started)
    output, _ = process.communicate(timeout=120)
    assert process.returncode != 0, output
    return output, started


def the_run(tmp_path: Path):
    client = MlflowClient(f"sqlite:///{tmp_path / 'outputs' / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("smoke").experiment_id])
    assert len(runs) == 1, [r.info.run_name for r in runs]  # no duplicate runs
    return client, runs[0]


def assert_each_epoch_once(client: MlflowClient, run_id: str, epochs: int) -> None:
    task = compose().task
    for key in epoch_metrics(task.type, task.metrics):
        assert sorted(m.step for m in client.get_metric_history(run_id, key)) == list(range(epochs)), key


@pytest.mark.slow
def test_ray_lost_under_a_run_fails_it_in_one_paragraph_and_leaves_no_process(tmp_path, data_root):
    """The local runtime's GCS and raylet SIGKILLed during epoch 2 (an OOM killer's choice): the command
    exits 1 with one paragraph saying Ray was lost and how to continue, the run is FAILED (not left
    RUNNING) with its epochs, and every process the command started is gone."""

    def kill_ray(command: subprocess.Popen, started: list[psutil.Process]) -> None:
        for process in started:
            with contextlib.suppress(psutil.Error):
                if process.name() in ("raylet", "gcs_server"):
                    process.kill()

    args = ["+experiment=smoke", *DETERMINISTIC, "tracking.run_name=lost"]
    output, started = stop_after_first_epoch(tmp_path, data_root, args, kill_ray)
    assert "Ray was lost under the run: " in output and "Traceback" not in output, output[-3000:]
    assert (
        "Once Ray is back, continue it with the same command plus: train.resume=true tracking.run_name=lost" in output
    )
    client, run_info = the_run(tmp_path)
    assert run_info.info.status == "FAILED" and "Ray was lost" in run_info.data.tags["pipeline.error"]
    assert len(client.get_metric_history(run_info.info.run_id, "train_loss")) >= 1
    assert_all_gone(started)


@pytest.mark.slow
def test_a_killed_worker_restarts_from_the_latest_checkpoint(tmp_path, data_root, ray_runtime, monkeypatch):
    """SIGKILL rank 1's RayTrainWorker process (its pid is in the run's workers.jsonl) while epoch 2 runs; with
    train.max_failures=1 the worker group restarts from epoch 1's checkpoint and the run finishes.
    (Ray's state API would name the pid too, but it needs the dashboard, which ray[data,train] lacks.)"""
    monkeypatch.setenv("PIPELINE_DATA_DIR", str(data_root))
    killed: list[str] = []

    def kill_a_worker() -> None:
        wait_for_epochs(tmp_path / "run", 1)
        workers = [json.loads(line) for line in (tmp_path / "run" / "workers.jsonl").read_text().splitlines()]
        pid = next(w["pid"] for w in workers if w["rank"] == 1)
        worker = psutil.Process(pid)
        title = " ".join(worker.cmdline())
        worker.kill()
        killed.append(title)

    killer = threading.Thread(target=kill_a_worker, daemon=True)
    killer.start()
    metrics, _ = in_process(
        tmp_path,
        "run",
        [
            "source.limit=null",
            "ingest.batch_size=16",
            "train.epochs=3",
            "train.max_failures=1",
            "train.num_to_keep=1",
            "train.checkpoint_metric=val_accuracy",
        ],
    )
    killer.join(timeout=5)
    assert killed and killed[0].startswith("ray::RayTrainWorker")
    client = MlflowClient(f"sqlite:///{tmp_path / 'outputs' / 'mlflow.db'}")
    (run_info,) = client.search_runs([client.get_experiment_by_name("smoke").experiment_id])
    assert run_info.info.status == "FINISHED" and metrics["val_accuracy"] == run_info.data.metrics["val_accuracy"]
    assert_each_epoch_once(client, run_info.info.run_id, 3)
    restores = client.get_metric_history(run_info.info.run_id, "restores")
    assert len(restores) == 1 and restores[0].step in (1, 2)
    # num_to_keep=1 by val_accuracy: Ray keeps the best checkpoint and the latest (one if they coincide).
    storage = Path(run_info.data.tags["pipeline.storage"])
    kept = json.loads((storage / "checkpoint_manager_snapshot.json").read_text())["checkpoint_results"]
    epochs = {
        torch.load(storage / c["checkpoint_dir_name"] / "checkpoint.pt", weights_only=True)["epoch"] for c in kept
    }
    reports = [json.loads(line)["ranks"][0] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    best = max(reversed(reports), key=lambda r: r["val_accuracy"])["epoch"]  # on a tie the later one wins
    assert epochs == {best, 2}, reports


@pytest.mark.slow  # Ray starts before the store is asked for the run
def test_resume_without_a_run_to_resume_is_a_clear_error(tmp_path, data_root, monkeypatch):
    monkeypatch.setenv("PIPELINE_DATA_DIR", str(data_root))
    cfg = compose_cfg(
        [
            "+experiment=smoke",
            f"paths.outputs={tmp_path / 'outputs'}",
            "train.resume=true",
            "tracking.run_name=never-ran",
        ]
    )
    with pytest.raises(PipelineError, match=r"train.resume=true: no run named 'never-ran'"):
        run(cfg, Job(str(tmp_path / "run"), "smoke"))


def test_a_ctrl_c_swallowed_where_it_landed_still_stops_training(monkeypatch):
    """A KeyboardInterrupt raised inside a finalizer is only printed; the request it made still ends fit()."""
    from pipeline.common import signals
    from pipeline.training import trainer

    monkeypatch.setattr(signals, "_requests", [])

    class SlowTrainer:  # stands in for TorchTrainer: fit() would return after 10 s
        def fit(self) -> str:
            time.sleep(10)
            return "finished"

    def swallowed_ctrl_c() -> None:
        with contextlib.suppress(KeyboardInterrupt):  # what happens to it inside a __del__
            signals.request_stop(KeyboardInterrupt())

    threading.Timer(0.3, swallowed_ctrl_c).start()
    with pytest.raises(KeyboardInterrupt):  # not "finished"
        trainer.fit_off_main_thread(SlowTrainer())
