"""The tracking server away under a run (a real ``mlflow server`` on 127.0.0.1, killed by pid and started again
on the same port and database; the runs train inside pytest's process, on its Ray runtime): training goes on
without it, and its record reaches it once it is back, at the run's end or later through ``python -m
pipeline.sync``, each epoch once. The MLflow client gives up on the server within seconds here
(MLFLOW_HTTP_REQUEST_MAX_RETRIES=2), standing for an outage longer than its default retries (about four
minutes)."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pyarrow.fs as pafs
import pytest
from conftest import capture_warnings, free_port, in_process
from mlflow import MlflowClient
from servers import mlflow_server, with_descendants
from test_fault_tolerance import assert_each_epoch_once, wait_for_epochs
from test_pipeline import cli_env

from pipeline.common.errors import PipelineError

pytestmark = pytest.mark.slow
CLIENT_GIVES_UP = ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")  # about 6 s of retries instead of about 4 min
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
        self.running = None


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One server for the module's runs, each in an experiment of its own."""
    started = Server(tmp_path_factory.mktemp("server"))
    started.start()
    yield started
    if started.running is not None:
        started.running.close()


def cmdline(process: psutil.Process) -> str:
    with contextlib.suppress(psutil.Error):
        return " ".join(process.cmdline())
    return ""


def train_while_away(server: Server, tmp_path: Path, name: str, *overrides: str, back_after_s: float | None = None):
    """Train run ``name`` (in an experiment of that name), logged to ``server``, inside pytest's process; a
    helper thread crashes the server once the run is created and its record spooled (before its first
    epoch), so every epoch trains while it is away, and with ``back_after_s`` starts it again that long
    after every epoch was reported. The run's metrics, or its error."""
    events: dict = {}

    def outage() -> None:
        spool, deadline = tmp_path / "run" / "mlflow-spool.jsonl", time.monotonic() + 300
        while not spool.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        server.crash()
        if back_after_s is not None:
            wait_for_epochs(tmp_path / "run", EPOCHS)
            events["trained_while_away"] = server.running is None
            time.sleep(back_after_s)
            server.start()

    helper = threading.Thread(target=outage, daemon=True)
    helper.start()
    overrides = [
        f"tracking.uri={server.url}",
        f"tracking.experiment_name={name}",
        f"tracking.run_name={name}",
        *overrides,
    ]
    try:
        events["metrics"], _ = in_process(
            tmp_path, "run", [f"train.epochs={EPOCHS}", "tracking.system_metrics_s=null", *overrides]
        )
    except PipelineError as err:
        events["error"] = err
    helper.join(timeout=60)
    return events


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


def test_a_server_away_longer_than_the_clients_retries_gets_the_whole_run_once_it_is_back(
    server, tmp_path, data_root, ray_runtime, caplog, monkeypatch
):
    """Every epoch trains while the server is down; it stays down past the client's retries, comes back, and
    the run ends FINISHED with each epoch once, as if it had never gone."""
    monkeypatch.setenv("PIPELINE_DATA_DIR", str(data_root))
    monkeypatch.setenv(*CLIENT_GIVES_UP)
    capture_warnings(caplog, monkeypatch, "pipeline.tracking.spool")
    events = train_while_away(server, tmp_path, "away", back_after_s=3)  # with the start's 7 s: past the retries
    assert "error" not in events, events.get("error")
    assert events["trained_while_away"]  # the driver had every epoch's report while the server was down
    assert "the MLflow tracking server does not answer; training goes on" in caplog.text
    assert "the MLflow tracking server answers again after" in caplog.text
    assert_recorded(MlflowClient(server.url), "away")


def test_a_server_that_never_returns_leaves_the_record_for_sync_to_upload_into_the_same_run(
    server, tmp_path, data_root, ray_runtime, s3_endpoint, monkeypatch
):
    """The server stays down past ``tracking.server_wait_s``: the run fails with a paragraph naming the spool
    and the command that uploads it; the spool is copied beside the checkpoints. Once a server answers on the
    same database, ``python -m pipeline.sync`` completes the same run from the copy, put in S3 (as a job's
    storage would hold it) without the marker of what was sent: every record is sent again, each epoch
    still once."""
    monkeypatch.setenv("PIPELINE_DATA_DIR", str(data_root))
    monkeypatch.setenv(*CLIENT_GIVES_UP)
    error = train_while_away(server, tmp_path, "gone", "tracking.server_wait_s=3")["error"]
    spool = tmp_path / "run" / "mlflow-spool.jsonl"
    assert f"Once the server answers, upload it into the same run with: python -m pipeline.sync {spool}" in str(error)
    header = json.loads(spool.read_text().splitlines()[0])
    assert header["tracking_uri"] == server.url and f"run 'gone' ({header['run_id']})" in str(error)
    (copy,) = (tmp_path / "run" / "checkpoints").glob("*/mlflow-spool.jsonl")
    assert copy.read_text() == spool.read_text() and copy.parent.name == header["run_id"]

    server.start()
    client = MlflowClient(server.url)
    assert client.get_run(header["run_id"]).info.status == "RUNNING"  # what the server took before it went
    fs = pafs.S3FileSystem(endpoint_override=s3_endpoint)
    with fs.open_output_stream("runs/spool/mlflow-spool.jsonl") as out:  # not its .sent: everything sent again
        out.write(copy.read_bytes())
    env = {**cli_env(data_root), "MLFLOW_TRACKING_URI": server.url, "AWS_ENDPOINT_URL": s3_endpoint}
    synced = subprocess.run(
        [sys.executable, "-m", "pipeline.sync", "s3://runs/spool/mlflow-spool.jsonl"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert synced.returncode == 0, (synced.stdout + synced.stderr)[-3000:]
    assert "into run 'gone', now FINISHED" in synced.stdout + synced.stderr
    assert assert_recorded(client, "gone") == header["run_id"]
