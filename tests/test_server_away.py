"""The tracking server away under a run (a real ``mlflow server`` on 127.0.0.1, stopped by pid and started again on
the same port and database): training goes on without it, and its record reaches it once it is back, at the
run's end or later through ``python -m pipeline.sync``, each epoch once. The MLflow client gives up on the
server within seconds here (MLFLOW_HTTP_REQUEST_MAX_RETRIES=2), standing for an outage longer than its
default retries (about four minutes)."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import free_port
from mlflow import MlflowClient
from servers import mlflow_server, with_descendants
from test_fault_tolerance import assert_each_epoch_once, wait_for_epochs
from test_pipeline import cli_env

pytestmark = pytest.mark.slow
CLIENT_GIVES_UP = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2"}  # about 6 s of retries instead of about 4 min
EPOCHS = 2


class Server:
    """An MLflow tracking server on a SQLite database and a local artifact directory, stopped and started
    again on the same port."""

    def __init__(self, root: Path):
        self.backend, self.artifacts = f"sqlite:///{root / 'mlflow.db'}", str(root / "artifacts")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.running: contextlib.ExitStack | None = None

    def start(self) -> None:
        self.running = contextlib.ExitStack()
        self.running.enter_context(mlflow_server(self.backend, self.artifacts, port=self.port))

    def crash(self) -> None:
        """SIGKILL the server and its workers, as a lost machine would end them."""
        for process in with_descendants([p for p in psutil.process_iter() if f"--port {self.port}" in cmdline(p)]):
            with contextlib.suppress(psutil.Error):
                process.kill()
        self.running.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One server for the module's runs, each in an experiment of its own."""
    started = Server(tmp_path_factory.mktemp("server"))
    started.start()
    yield started
    started.running.close()


def cmdline(process: psutil.Process) -> str:
    with contextlib.suppress(psutil.Error):
        return " ".join(process.cmdline())
    return ""


def train_while_away(server: Server, tmp_path: Path, data_root: Path, name: str, *overrides: str) -> subprocess.Popen:
    """Start run ``name`` (in an experiment of that name) logged to ``server``, and crash the server once the
    run is created and its record spooled (before its first epoch): every epoch trains while it is away."""
    command = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pipeline",
            "+experiment=smoke",
            f"train.epochs={EPOCHS}",
            f"tracking.experiment_name={name}",
            f"tracking.run_name={name}",
            "tracking.system_metrics_s=null",
            "hydra.run.dir=run",
            *overrides,
        ],
        cwd=tmp_path,
        env={**cli_env(data_root), "MLFLOW_TRACKING_URI": server.url, **CLIENT_GIVES_UP},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    spool, deadline = tmp_path / "run" / "mlflow-spool.jsonl", time.monotonic() + 300
    while not spool.exists():
        assert command.poll() is None and time.monotonic() < deadline, command.communicate()[0][-3000:]
        time.sleep(0.1)
    server.crash()
    return command


def assert_recorded(client: MlflowClient, name: str) -> str:
    """The run ``name`` (the only one of its experiment) FINISHED with every epoch once, its checkpoints'
    LoggedModels READY with their files, the best one its model, and its learning curve; the run's id."""
    (run,) = client.search_runs([client.get_experiment_by_name(name).experiment_id])
    assert run.info.run_name == name and run.info.status == "FINISHED"
    assert_each_epoch_once(client, run.info.run_id, EPOCHS)
    models = client.search_logged_models([run.info.experiment_id])
    assert sorted(m.name for m in models) == [f"checkpoint-{epoch}" for epoch in range(EPOCHS)]
    assert all(str(m.status) == "READY" for m in models)
    assert run.data.tags["pipeline.model_id"] in {m.model_id for m in models}
    assert {"learning_curve.png", "model"} <= {f.path for f in client.list_artifacts(run.info.run_id)}
    return run.info.run_id


def test_a_server_away_longer_than_the_clients_retries_gets_the_whole_run_once_it_is_back(server, tmp_path, data_root):
    """Every epoch trains while the server is down; it stays down past the client's retries, comes back, and
    the run ends FINISHED with each epoch once, as if it had never gone."""
    command = train_while_away(server, tmp_path, data_root, "away")
    stopped_at = time.monotonic()
    wait_for_epochs(tmp_path / "run", EPOCHS)  # the driver had every epoch's report while the server was down
    time.sleep(max(0.0, 8 - (time.monotonic() - stopped_at)))  # with the start's 7 s: twice the client's retries
    server.start()
    output, _ = command.communicate(timeout=300)
    assert command.returncode == 0, output[-3000:]
    assert "the MLflow tracking server does not answer; training goes on" in output
    assert "the MLflow tracking server answers again after" in output and "Traceback" not in output
    assert_recorded(MlflowClient(server.url), "away")


def test_a_server_that_never_returns_leaves_the_record_for_sync_to_upload_into_the_same_run(
    server, tmp_path, data_root
):
    """The server stays down past ``tracking.server_wait_s``: the command exits 1 naming the spool and the
    command that uploads it; the spool is copied beside the checkpoints. Once a server answers on the same
    database, ``python -m pipeline.sync`` completes the same run, every record sent again (the marker of
    what was sent removed) and each epoch still once."""
    command = train_while_away(server, tmp_path, data_root, "gone", "tracking.server_wait_s=3")
    output, _ = command.communicate(timeout=300)
    spool = tmp_path / "run" / "mlflow-spool.jsonl"
    assert command.returncode == 1, output[-3000:]
    assert f"Once the server answers, upload it into the same run with: python -m pipeline.sync {spool}" in output
    assert "Traceback" not in output
    header = json.loads(spool.read_text().splitlines()[0])
    assert header["tracking_uri"] == server.url
    (copy,) = (tmp_path / "run" / "checkpoints").glob("*/mlflow-spool.jsonl")
    assert copy.read_text() == spool.read_text() and copy.parent.name == header["run_id"]

    server.start()
    client = MlflowClient(server.url)
    assert client.get_run(header["run_id"]).info.status == "RUNNING"  # what the server took before it went
    Path(f"{spool}.sent").unlink(missing_ok=True)  # delivered twice: each record must still count once
    env = {**cli_env(data_root), "MLFLOW_TRACKING_URI": server.url}
    synced = subprocess.run(
        [sys.executable, "-m", "pipeline.sync", str(spool)], env=env, capture_output=True, text=True
    )
    assert synced.returncode == 0, (synced.stdout + synced.stderr)[-3000:]
    assert "into run 'gone', now FINISHED" in synced.stdout + synced.stderr
    assert assert_recorded(client, "gone") == header["run_id"]
