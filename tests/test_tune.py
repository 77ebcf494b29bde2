"""Sweeps on Ray Tune (hparams_search=tune) end to end, from a separate process as a user runs them:
a sweep killed with SIGKILL continued by the same command. (Trials at once, one per node, and a
scheduler stopping a bad trial: the two-node sweep in test_cluster.py.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient
from test_pipeline import cli_env, run_cli


def sweep_runs(workdir: Path, experiment: str = "wine_mlp") -> tuple:
    client = MlflowClient(f"sqlite:///{workdir / 'outputs' / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    (parent,) = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = sorted((r for r in runs if r is not parent), key=lambda r: r.info.start_time)
    return client, parent, children


def epochs_logged(client: MlflowClient, run) -> list[int]:
    return [m.step for m in client.get_metric_history(run.info.run_id, "val_accuracy")]


@pytest.mark.slow
def test_a_sweep_killed_after_its_first_trial_continues_with_the_same_command(tmp_path):
    """SIGKILL to the command once a trial has finished; the same command then ends the sweep: every
    trial in MLflow once, the finished one untouched, the interrupted one continued in its own run."""
    args = [
        "-m",
        "+experiment=wine_mlp",
        "hparams_search=tune",
        "hydra/sweeper/scheduler=fifo",
        "optim.lr=3e-3,1e-2",
        "hydra.sweeper.num_samples=1",
        "hydra.sweeper.max_concurrent_trials=1",
        "train.epochs=1",
        "ray.num_cpus=4",
        "hydra.sweep.dir=sweep",
    ]
    command = subprocess.Popen(
        [sys.executable, "-m", "pipeline", *args],
        cwd=tmp_path,
        env=cli_env(tmp_path / "data"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.time() + 400
        while time.time() < deadline and command.poll() is None:
            time.sleep(0.5)
            if (tmp_path / "outputs" / "mlflow.db").exists() and (tmp_path / "sweep" / "tune").exists():
                try:
                    _, _, children = sweep_runs(tmp_path)
                except (ValueError, AttributeError):  # no parent yet
                    continue
                if any(c.info.status == "FINISHED" for c in children):
                    break
        assert command.poll() is None, "the sweep ended before the test could kill it"
        time.sleep(1.5)  # Tune saves its state every second (TUNE_GLOBAL_CHECKPOINT_S): the finished trial is in it
        os.kill(command.pid, signal.SIGKILL)
    finally:
        command.kill()
        command.wait()
    client, _, before = sweep_runs(tmp_path)
    finished = {c.data.tags["pipeline.tune_trial_id"]: c for c in before if c.info.status == "FINISHED"}
    assert len(finished) == 1  # killed between the trials' ends, not after the last

    result = run_cli(args, tmp_path, tmp_path / "data")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "continuing the sweep" in output and "2 jobs, 0 failed" in output
    client, parent, after = sweep_runs(tmp_path)
    trials = [c.data.tags["pipeline.tune_trial_id"] for c in after]
    assert len(after) == 2 and len(set(trials)) == 2  # every trial exactly once
    assert all(c.info.status == "FINISHED" and epochs_logged(client, c) == [0] for c in after)
    for c in after:  # each trial's checkpoints and reports in its own folder of the sweep
        trial_dir = tmp_path / "sweep" / c.data.tags["pipeline.tune_trial_id"]
        assert c.data.tags["pipeline.storage"].startswith(str(trial_dir / "checkpoints"))
        assert (trial_dir / "metrics.jsonl").exists()
    for trial, run in finished.items():  # not re-run: the run is as the killed sweep left it
        (again,) = [c for c in after if c.data.tags["pipeline.tune_trial_id"] == trial]
        assert again.info.end_time == run.info.end_time
    assert parent.info.status == "FINISHED"
