"""The cluster route as a team runs it (docs/cluster.md): a ``ray start`` head node with Ray's default token
authentication, commands submitted to it as Ray jobs from a copy of the project, and one MLflow tracking
server on PostgreSQL with artifacts proxied to an S3 server. All real, on 127.0.0.1, each ended by pid.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import boto3
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
import torch
from conftest import AWS_SECRET, DETERMINISTIC, alive
from mlflow import MlflowClient
from servers import BIN, mlflow_server, postgres, postgres_available, ray_head
from test_pipeline import cli_env
from test_s3 import checkpoints, files_containing

from pipeline.common import workarounds
from pipeline.training import checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.skipif(postgres_available() is not None, reason=str(postgres_available()))]
ROOT = Path(__file__).resolve().parents[1]
# `ray job stop JOB` once a line comes on stdin: the CLI imported ahead (seconds on a busy machine, an epoch here)
STOP_WHEN_TOLD = (
    "import sys, ray.scripts.scripts as cli; sys.stdin.readline(); "
    "sys.argv[:] = ['ray', 'job', 'stop', sys.argv[1]]; cli.main()"
)


@pytest.fixture(scope="module")
def head():
    with ray_head(num_cpus=2) as started:  # this machine's cores: a job's tasks no more than they can run
        yield started
    assert alive(started.session_processes()) == {}  # nothing of the cluster left behind


@pytest.fixture(scope="module")
def tracking_server(s3_endpoint):
    """The team's server: runs in PostgreSQL, artifacts in s3://runs/mlartifacts through the server."""
    with postgres() as database, mlflow_server(database, "s3://runs/mlartifacts", s3_endpoint) as url:
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
    submitted = smoke.replace("limit: 2000", "limit: 512")  # one worker, as smoke: in the job's driver process
    (copy / "conf/experiment/submitted.yaml").write_text(submitted + "tracking:\n  register_as: submitted\n")
    return copy


def submit(
    head, project: Path, command: list[str], env_vars: dict[str, str], *options: str
) -> subprocess.CompletedProcess:
    """``ray job submit --working-dir PROJECT -- python -m pipeline ...`` as docs/cluster.md has it: the
    Jobs API at RAY_ADDRESS, RAY_AUTH_MODE=token with the head's token in ~/.ray/auth_token."""
    return ray_job(
        head,
        "submit",
        *options,
        "--working-dir",
        str(project),
        "--runtime-env-json",
        json.dumps({"env_vars": env_vars}),
        "--",
        *command,
    )


def driver(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """``python -m pipeline ARGS`` on this machine: a driver of its own, not a job."""
    return subprocess.run(
        [sys.executable, "-m", "pipeline", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def ray_job(head, *args: str) -> subprocess.CompletedProcess:
    """``ray job ARGS`` against the head's Jobs API, as a client with its token."""
    return subprocess.run(
        [str(BIN / "ray"), "job", *args],
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
    done = driver(["+experiment=smoke", f"paths.outputs={tmp_path / 'outputs'}"], tmp_path, env)
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
    evaluate = driver(
        [
            "+experiment=submitted",
            "stage=evaluate",
            "predict.run=models:/submitted@champion",
            f"predict.output={tmp_path / 'evaluated'}",
        ],
        project,
        {**joined, "RAY_ADDRESS": head.address},
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


def whole_checkpoints(fs: pafs.FileSystem, storage: str) -> list[str]:
    """The checkpoints under an s3:// run storage that a resume can continue from (whole), oldest first."""
    found = checkpoint.reports(fs, storage.removeprefix("s3://"))
    return [path for path, report in found if checkpoint.whole(fs, path, report)]


def test_an_s3_job_stopped_by_ray_job_stop_resumes_into_the_same_run_and_matches_the_local_run(
    head, project, tracking_server, s3_endpoint, deterministic_run, tmp_path
):
    """Data and checkpoints on S3, the run on the tracking server. ``ray job stop`` during epoch 2, with Ray's
    defaults (SIGKILL 3 s after SIGTERM): the workers checkpoint at the step they are on and the run is KILLED in
    MLflow by the time ``ray job stop`` returns; the same job submitted again with train.resume=true continues that
    run from that step, every epoch its checkpoints hold in MLflow once, and ends where an uninterrupted run from
    local files does. The AWS secret is
    nowhere: the jobs' logs, the run's params and config, the head's Ray logs."""
    command = [
        "python",
        "-m",
        "pipeline",
        "+experiment=smoke",
        *DETERMINISTIC,  # the same batches as the local run of the same config
        "source=s3",
        "source.root=s3://data/cifar10",
        f"source.s3.endpoint_url={s3_endpoint}",
        "source.s3.anonymous=false",
        "source.s3.region=us-east-1",
        "storage.path=s3://runs/checkpoints",
        f"storage.s3.endpoint_url={s3_endpoint}",
        "tracking.experiment_name=stopped",
        "tracking.run_name=long-run",
    ]
    env_vars = {"MLFLOW_TRACKING_URI": tracking_server}  # the credentials: the head's own environment
    started = submit(head, project, command, env_vars, "--no-wait")
    (job,) = re.findall(r"Job '(raysubmit_\w+)' submitted successfully", started.stdout)
    client, fs = MlflowClient(tracking_server), pafs.S3FileSystem(endpoint_override=s3_endpoint)
    stop = subprocess.Popen(
        [sys.executable, "-c", STOP_WHEN_TOLD, job],
        env={**head.env, "RAY_AUTH_MODE": "token", "RAY_ADDRESS": head.dashboard},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 300
        while not (runs := runs_of(client, "stopped")) or not checkpoints(
            fs, f"s3://runs/checkpoints/{runs[0].info.run_id}"
        ):
            assert time.monotonic() < deadline, (
                f"after 300 s: {len(runs)} run(s), no checkpoint on S3; the job's log:\n"
                + ray_job(head, "logs", job).stdout[-3000:]
            )
            time.sleep(0.2)  # until epoch 1's checkpoint is on S3: epoch 2 is under way
        _, stopped = stop.communicate("\n", timeout=120)
    finally:
        stop.kill()
    assert stop.returncode == 0, f"ray job stop exited {stop.returncode}:\n{stopped[-2000:]}"
    output = ray_job(head, "logs", job).stdout
    (run,) = runs_of(client, "stopped")
    assert run.info.status == "KILLED", f"the stopped run is {run.info.status}; the job's log:\n{output[-3000:]}"
    assert "Traceback" not in output, f"a traceback in the stopped job's log:\n{output[-3000:]}"
    assert "train.resume=true tracking.run_name=long-run" in output, f"no resume hint in:\n{output[-3000:]}"
    # stopped during epoch 2 (or right after it); epoch 1's record may still have been in the spool at SIGKILL
    reached = len(client.get_metric_history(run.info.run_id, "train_loss"))
    assert reached in (0, 1, 2), f"{reached} epochs logged before the stop"
    storage = f"s3://runs/checkpoints/{run.info.run_id}"
    assert run.data.tags["pipeline.storage"] == storage
    before = whole_checkpoints(fs, storage)  # a copy the SIGKILL cut short is left out, as a resume leaves it
    assert before, f"no whole checkpoint in {checkpoints(fs, storage)}"
    before_epochs = [checkpoint.read_report(fs, path)["epoch"] for path in before]
    newest = before_epochs[-1]
    # never behind the record; ahead when the driver was killed before the rest reached MLflow (resuming logs it)
    assert newest >= reached - 1, f"newest checkpoint epoch {newest}, {reached} epochs logged"

    # Ray Train records a checkpoint only after its copy to storage, so a stop between the two leaves the
    # newest unrecorded. Without Ray's record at all, the job must continue from the newest whole checkpoint
    # it finds. (A stop before Ray's first record leaves no record to remove.)
    with contextlib.suppress(FileNotFoundError):
        fs.delete_file(f"{storage.removeprefix('s3://')}/checkpoint_manager_snapshot.json")
    resumed = submit(head, project, [*command, "train.resume=true"], env_vars)
    output += resumed.stdout + resumed.stderr
    assert "succeeded" in resumed.stdout, f"the resumed job did not succeed; its log:\n{output[-3000:]}"
    runs = runs_of(client, "stopped")
    assert len(runs) == 1, f"{len(runs)} runs named long-run: the resumed job started a new one"
    (run,) = runs
    assert run.data.tags["pipeline.storage"] == storage, run.data.tags
    assert run.info.status == "FINISHED", f"the resumed run is {run.info.status}; its log:\n{output[-3000:]}"
    for key in ("train_loss", "val_loss", "val_accuracy"):  # each epoch once
        steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, key))
        assert steps == [0, 1, 2], f"{key} logged at steps {steps}"
    (restored,) = [m.step for m in client.get_metric_history(run.info.run_id, "restores")]
    # the workers checkpoint at the step they are on once the notice reaches them, within Ray's 3 s: the resume goes
    # on from that step. On a busy machine the stop can also land as an epoch ends, or the SIGKILL before the step's
    # checkpoint is whole in storage (a timing, not the feature: test_preemption pins the step checkpoint); then the
    # resume starts the epoch after the newest whole one, an epoch's end
    if f"continuing at epoch {restored + 1}/3 after its step" in output:
        (step,) = [m.value for m in client.get_metric_history(run.info.run_id, "restored_at_step")]
        assert step > restored * (512 // 16), step  # past the epoch's start: 512 rows a worker, batches of 16
        assert restored == newest, (restored, newest)
    else:
        assert f"continuing at epoch {restored + 1}/3 on 1 worker" in output, output[-3000:]
        assert restored == newest + 1, (restored, newest)
    assert run.data.params["source.train"] == "s3://data/cifar10/train"

    # Checkpoints went to the S3 server, load safely and hold the weights MLflow logged.
    saved = whole_checkpoints(fs, storage)
    # train.num_to_keep=2 (one worker: local mode keeps them over what storage holds, by Ray Train's rule): the newest
    # two written, the stopped job's step checkpoint among them when the resume trained one epoch only after it
    trained = list(range(restored, 3))  # the epochs the resumed job checkpointed
    written = before_epochs + trained
    assert [checkpoint.read_report(fs, path)["epoch"] for path in saved] == written[-2:], (saved, before, restored)
    assert len(set(saved) - set(before)) == min(2, len(trained)), (saved, before, restored)
    with fs.open_input_file(f"{saved[-1]}/{checkpoint.CHECKPOINT_FILE}") as stream:
        last = torch.load(stream, weights_only=True)
    logged = torch.load(
        client.download_artifacts(run.info.run_id, "model/state_dict.pt", str(tmp_path)), weights_only=True
    )
    assert last["epoch"] == 2 and all(torch.equal(last["model"][k], logged[k]) for k in logged)

    # Deterministic on CPU: the S3 run, stopped and resumed, ends where an uninterrupted local one does.
    ended = {key: run.data.metrics[key] for key in ("val_accuracy", "val_loss", "train_loss")}
    assert deterministic_run["val_accuracy"] == run.data.metrics["val_accuracy"], (ended, deterministic_run)
    assert deterministic_run["val_loss"] == pytest.approx(run.data.metrics["val_loss"], abs=1e-6)
    assert deterministic_run["train_loss"] == pytest.approx(run.data.metrics["train_loss"], abs=1e-6)

    # The secret the AWS SDK used is nowhere: the jobs' logs, the run's record, the head's Ray logs.
    secret = AWS_SECRET.encode()
    assert secret not in output.encode() and AWS_SECRET not in json.dumps(run.data.params)
    assert files_containing(tmp_path, secret) == [] and files_containing(head.temp_dir, secret) == []


def runs_of(client: MlflowClient, name: str) -> list:
    """The runs of experiment ``name`` (none while it does not exist yet)."""
    experiment = client.get_experiment_by_name(name)
    return client.search_runs([experiment.experiment_id]) if experiment else []


def launcher(
    head, project: Path, tracking_server: str, data_root: Path, *args: str, token: bool = True
) -> subprocess.Popen:
    """``python -m pipeline -m hydra/launcher=ray_jobs ARGS`` from the project, as a user's shell with the cluster's
    address and token (sent with ``token``) and the team's server runs it."""
    env = {
        **cli_env(data_root),
        "HOME": head.env["HOME"],
        "RAY_ADDRESS": head.dashboard,
        "MLFLOW_TRACKING_URI": tracking_server,
    }
    env.pop("RAY_AUTH_MODE", None)  # a local ray.init() in this process may have set it
    if token:
        env["RAY_AUTH_MODE"] = "token"
    return subprocess.Popen(
        [sys.executable, "-m", "pipeline", "-m", "hydra/launcher=ray_jobs", "+experiment=submitted", *args],
        cwd=project,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


LIST_JOBS = (
    "import json, sys; from ray.job_submission import JobSubmissionClient; "
    "print(json.dumps([[j.metadata, str(j.status.value)] for j in JobSubmissionClient(sys.argv[1]).list_jobs()]))"
)


def sweep_jobs(head, sweep_dir: str) -> dict[int, str]:
    """The Ray jobs a sweep submitted, by job number: their status on the cluster (asked with the head's token)."""
    listed = subprocess.run(
        [sys.executable, "-c", LIST_JOBS, head.dashboard],
        env={**head.env, "RAY_AUTH_MODE": "token"},
        capture_output=True,
        text=True,
        check=True,
    )
    jobs = json.loads(listed.stdout.strip().splitlines()[-1])
    return {int(meta["job"]): status for meta, status in jobs if (meta or {}).get("sweep") == sweep_dir}


def sweep_runs(client: MlflowClient, experiment: str) -> tuple[object, dict[str, object]]:
    """A sweep's parent run and its children by run name."""
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    (parent,) = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = {r.info.run_name: r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id}
    assert len(children) == len(runs) - 1
    return parent, children


def test_each_job_of_a_sweep_is_a_ray_job_and_a_child_run_on_the_server_and_a_failed_one_fails_alone(
    head, project, tracking_server, data_root, tmp_path
):
    """hydra/launcher=ray_jobs against the token cluster: four jobs, two at once; the three good ones SUCCEEDED as Ray
    jobs and FINISHED as children of one parent on the server; the one whose learning rate AdamW refuses FAILED in
    both, the sweep went on, and its summary names it and exits 1."""
    sweep_dir = str(tmp_path / "sweep")
    storage = f"storage.path={tmp_path / 'checkpoints'}"  # an absolute path: this head's disk
    args = ["optim.lr=1e-3,3e-3,1e-2,-1", storage, "tracking.experiment_name=ray_jobs", "tracking.register_as=null"]
    sweep = launcher(
        head,
        project,
        tracking_server,
        data_root,
        *args,
        "hydra.launcher.max_concurrent=2",
        f"hydra.sweep.dir={sweep_dir}",
    )
    output, _ = sweep.communicate(timeout=900)
    assert sweep.returncode == 1, output[-4000:]  # one job failed
    assert sweep_jobs(head, sweep_dir) == {0: "SUCCEEDED", 1: "SUCCEEDED", 2: "SUCCEEDED", 3: "FAILED"}, output[-4000:]
    parent, children = sweep_runs(MlflowClient(tracking_server), "ray_jobs")
    jobs = {name.split(":")[0]: run for name, run in children.items()}  # job N: its overrides
    statuses = {name: run.info.status for name, run in jobs.items()}
    assert statuses == {"job 0": "FINISHED", "job 1": "FINISHED", "job 2": "FINISHED", "job 3": "FAILED"}, (
        output[-4000:],
        {name: run.data.tags.get("pipeline.error") for name, run in jobs.items()},
    )
    assert sorted(float(run.data.params["optim.lr"]) for run in jobs.values()) == [-1, 1e-3, 3e-3, 1e-2]
    assert "Invalid learning rate" in jobs["job 3"].data.tags["pipeline.error"]
    assert parent.info.status == "FAILED" and parent.data.tags["pipeline.sweep_dir"] == sweep_dir
    assert parent.data.tags["pipeline.best_run_id"] in {r.info.run_id for r in children.values()}
    assert "4 jobs, 1 failed" in output


def test_ctrl_c_on_a_ray_jobs_sweep_stops_the_jobs_it_submitted_and_their_runs(
    head, project, tracking_server, data_root, tmp_path
):
    """Ctrl-C while two jobs of a sweep train on the cluster: both Ray jobs STOPPED, their runs KILLED (each job's
    driver took Ray's SIGTERM as a stop), the sweep's parent KILLED, the command exits 130."""
    sweep_dir = str(tmp_path / "sweep")
    storage = f"storage.path={tmp_path / 'checkpoints'}"
    args = ["optim.lr=1e-3,3e-3", storage, "tracking.experiment_name=stopped_sweep", "tracking.register_as=null"]
    sweep = launcher(
        head, project, tracking_server, data_root, *args, "train.epochs=100", f"hydra.sweep.dir={sweep_dir}"
    )
    client, deadline = MlflowClient(tracking_server), time.monotonic() + 300
    try:
        while True:  # until both jobs' runs train: each has logged its first epoch
            experiment = client.get_experiment_by_name("stopped_sweep")
            runs = client.search_runs([experiment.experiment_id]) if experiment else []
            if sum("val_loss" in r.data.metrics for r in runs) == 2:
                break
            assert time.monotonic() < deadline and sweep.poll() is None, sweep.communicate()[0][-3000:]
            time.sleep(1)
        sweep.send_signal(signal.SIGINT)
        output, _ = sweep.communicate(timeout=180)
    finally:
        sweep.kill()
    assert sweep.returncode == 130, output[-4000:]
    assert sweep_jobs(head, sweep_dir) == {0: "STOPPED", 1: "STOPPED"}, output[-4000:]
    parent, children = sweep_runs(client, "stopped_sweep")
    assert [run.info.status for run in children.values()] == ["KILLED", "KILLED"]
    assert parent.info.status == "KILLED"
    assert "Traceback" not in output, output[-4000:]


def test_a_ray_jobs_sweep_without_the_token_mode_is_one_paragraph_and_leaves_no_run(
    head, project, tracking_server, data_root, tmp_path
):
    """The launcher asked the token cluster's Jobs API without RAY_AUTH_MODE=token: one paragraph naming the fix, exit
    1, no job submitted and no parent run left behind on the server."""
    sweep_dir = str(tmp_path / "sweep")
    args = ["optim.lr=1e-3,3e-3", "tracking.experiment_name=refused", f"hydra.sweep.dir={sweep_dir}"]
    sweep = launcher(head, project, tracking_server, data_root, *args, token=False)
    output, _ = sweep.communicate(timeout=300)
    assert sweep.returncode == 1, output[-4000:]
    assert "the cluster's Jobs API at http://127.0.0.1" in output and "Export RAY_AUTH_MODE=token" in output
    assert "Traceback" not in output, output[-4000:]
    assert sweep_jobs(head, sweep_dir) == {}
    experiment = MlflowClient(tracking_server).get_experiment_by_name("refused")
    assert experiment is None or MlflowClient(tracking_server).search_runs([experiment.experiment_id]) == []
