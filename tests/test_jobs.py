"""The cluster route as a team runs it (docs/cluster.md): a ``ray start`` head node with Ray's default token
authentication, commands submitted to it as Ray jobs from a copy of the project, and one MLflow tracking
server on PostgreSQL with artifacts proxied to an S3 server. All real, on 127.0.0.1, each ended by pid.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import boto3
import pyarrow.parquet as pq
import pytest
import torch
from conftest import alive
from mlflow import MlflowClient
from servers import BIN, mlflow_server, postgres, postgres_available, ray_head
from test_pipeline import cli_env

from pipeline import workarounds

pytestmark = [pytest.mark.slow, pytest.mark.skipif(postgres_available() is not None, reason=str(postgres_available()))]
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def head():
    with ray_head(num_cpus=2) as started:  # this machine's cores: a job's tasks no more than they can run
        yield started
    assert alive(started.session_processes()) == {}  # nothing of the cluster left behind


@pytest.fixture(scope="module")
def tracking_server(s3_endpoint):
    """The team's server: runs in PostgreSQL, artifacts in s3://runs/mlartifacts through the server."""
    with postgres() as database, mlflow_server(database, s3_endpoint, "s3://runs/mlartifacts") as url:
        yield url


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """The project as a user submits it (``--working-dir .``), with an experiment only this copy has: a
    job that composes it ran the code it was submitted with, not the installed package."""
    copy = tmp_path_factory.mktemp("submitted") / "project"
    shutil.copytree(
        ROOT,
        copy,
        ignore=shutil.ignore_patterns(".venv", ".git", "outputs", "__pycache__", "*_cache", "*.egg-info"),
    )
    smoke = (copy / "conf/experiment/smoke.yaml").read_text()
    submitted = smoke.replace("limit: 2000", "limit: 512") + "scaling:\n  num_workers: 1\n"
    (copy / "conf/experiment/submitted.yaml").write_text(submitted + "tracking:\n  register_as: submitted\n")
    return copy


def submit(head, project: Path, command: list[str], env_vars: dict[str, str]) -> subprocess.CompletedProcess:
    """``ray job submit --working-dir PROJECT -- python -m pipeline ...`` as docs/cluster.md has it: the
    Jobs API at RAY_ADDRESS, RAY_AUTH_MODE=token with the head's token in ~/.ray/auth_token."""
    return subprocess.run(
        [
            str(BIN / "ray"),
            "job",
            "submit",
            "--working-dir",
            str(project),
            "--runtime-env-json",
            json.dumps({"env_vars": env_vars}),
            "--",
            *command,
        ],
        env={**head.env, "RAY_AUTH_MODE": "token", "RAY_ADDRESS": head.dashboard},
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_joining_a_token_cluster_without_the_token_mode_stops_before_anything_with_the_fix(head, tmp_path, data_root):
    """RAY_ADDRESS to a cluster with token authentication, from a shell that has the token but not
    RAY_AUTH_MODE=token (Ray sends no token to an address it is given): one paragraph naming the cause
    and the fix, exit 1, nothing recorded in MLflow."""
    env = {**cli_env(data_root), "HOME": head.env["HOME"], "RAY_ADDRESS": head.address}
    env.pop("RAY_AUTH_MODE", None)  # a local ray.init() in this process set it
    env["RAY_gcs_server_port_wait_time_s"] = "3"  # Ray's connection attempts: 3, not 20, for the test's time
    done = subprocess.run(
        [sys.executable, "-m", "pipeline", "+experiment=smoke", f"paths.outputs={tmp_path / 'outputs'}"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 1, output[-2000:]
    assert f"ray.address: the Ray cluster at '{head.address}' uses token authentication and refused" in output
    assert "this process sent no token" in output and "Export RAY_AUTH_MODE=token with the cluster's token" in output
    assert "Traceback" not in output and "cannot reach" not in output
    store = MlflowClient(f"sqlite:///{tmp_path / 'outputs' / 'mlflow.db'}")  # opened beside Ray's start
    assert [e.name for e in store.search_experiments()] == ["Default"]  # no experiment, no run


def test_a_job_with_no_tracking_server_stops_before_training(head, project, data_root):
    """A job whose run would be logged into its temporary working directory (no MLFLOW_TRACKING_URI,
    default paths): the job FAILS before Ray Train starts, with the paragraph saying what to set."""
    done = submit(
        head, project, ["python", "-m", "pipeline", "+experiment=submitted"], {"PIPELINE_DATA_DIR": str(data_root)}
    )
    output = done.stdout + done.stderr
    assert "runs as a Ray job, in a temporary copy of the submitted working directory" in output, output[-3000:]
    assert "tracking.uri (MLFLOW_TRACKING_URI) (outputs/mlflow.db) and storage.path (outputs)" in output
    assert "Job 'raysubmit_" in output and "failed" in output
    assert "epoch" not in output.lower()  # stopped before training


def test_a_submitted_sweep_logs_to_the_server_and_its_registered_model_predicts_through_it(
    head, project, tracking_server, s3_endpoint, data_root, tmp_path
):
    """A Hydra sweep submitted as a job trains with the code it was submitted with, logs its parent and
    children to the tracking server (PostgreSQL), its LoggedModels' files to S3 through the server, and
    moves the registry alias to the best child's version; a driver joining the cluster through RAY_ADDRESS
    evaluates (predicts, then scores) ``models:/submitted@champion`` through the server; the model loads
    here through the server too."""
    env_vars = {"PIPELINE_DATA_DIR": str(data_root), "MLFLOW_TRACKING_URI": tracking_server}
    storage = f"storage.path={tmp_path / 'checkpoints'}"  # an absolute path: this head's disk stays
    sweep = submit(
        head,
        project,
        ["python", "-m", "pipeline", "-m", "+experiment=submitted", "optim.lr=1e-3,3e-3", storage],
        env_vars,
    )
    assert "Job 'raysubmit_" in sweep.stdout and "succeeded" in sweep.stdout, (sweep.stdout + sweep.stderr)[-4000:]

    client = MlflowClient(tracking_server)
    experiment = client.get_experiment_by_name("submitted")
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"  # the UI opens on the runs
    runs = client.search_runs([experiment.experiment_id])
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert len(runs) == 3 and len(children) == 2
    assert all(r.info.status == "FINISHED" for r in runs)
    assert sorted(float(r.data.params["optim.lr"]) for r in children) == [1e-3, 3e-3]
    (parent,) = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    best = next(r for r in children if r.info.run_id == parent.data.tags["pipeline.best_run_id"])
    assert best.data.metrics["val_accuracy"] == max(r.data.metrics["val_accuracy"] for r in children)
    version = client.get_model_version_by_alias("submitted", "champion")
    assert version.run_id == best.info.run_id
    models = client.search_logged_models(experiment_ids=[experiment.experiment_id])
    assert {m.source_run_id for m in models} == {r.info.run_id for r in children}
    keys = [o["Key"] for o in boto3.client("s3", endpoint_url=s3_endpoint).list_objects_v2(Bucket="runs")["Contents"]]
    assert any(key.startswith("mlartifacts/") and key.endswith(".pt") for key in keys)  # the files are in S3

    # stage=evaluate (predict's path: models:/ through the server, then scored) from a driver on the user's
    # own machine, joining the head through RAY_ADDRESS with the token (docs/cluster.md's other route)
    joined = {**cli_env(data_root), **env_vars, "HOME": head.env["HOME"], "RAY_AUTH_MODE": "token"}
    evaluate = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline",
            "+experiment=submitted",
            "stage=evaluate",
            "predict.run=models:/submitted@champion",
            f"predict.output={tmp_path / 'evaluated'}",
        ],
        cwd=project,
        env={**joined, "RAY_ADDRESS": head.address},
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = evaluate.stdout + evaluate.stderr
    assert evaluate.returncode == 0, output[-4000:]
    assert f"Ray runtime up ({head.address}): 1 node(s)" in output
    (evaluation,) = [
        r for r in client.search_runs([experiment.experiment_id]) if r.data.tags.get("pipeline.stage") == "evaluate"
    ]
    assert evaluation.info.status == "FINISHED" and evaluation.data.tags["mlflow.parentRunId"] == best.info.run_id
    evaluated = pq.read_table(tmp_path / "evaluated")
    assert evaluated.num_rows == pq.read_table(data_root / "cifar10" / "test").num_rows
    assert evaluation.data.metrics["predict_accuracy"] == pytest.approx(
        (evaluated.column("prediction").to_numpy() == evaluated.column("label").to_numpy()).mean()
    )

    with workarounds.global_tracking_uri(tracking_server):
        model = workarounds.import_mlflow_pytorch().load_model("models:/submitted@champion", map_location="cpu")
    assert model(torch.zeros(2, 3, 32, 32, dtype=torch.uint8)).shape == (2, 10)  # the exported model takes raw images
    assert "AWS" not in json.dumps(client.get_run(best.info.run_id).data.params)  # no credentials logged
    assert os.environ["AWS_SECRET_ACCESS_KEY"] not in (sweep.stdout + sweep.stderr)
