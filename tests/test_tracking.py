"""The tracking stage against a real MLflow store: what it writes, and what it must never write."""

from __future__ import annotations

from conftest import compose_cfg
from mlflow import MlflowClient

from pipeline import runs, tracking
from pipeline.build import Job


def test_secrets_in_uris_and_runtime_env_never_reach_mlflow(tmp_path):
    """Passwords in URIs, and the env_vars a cluster's workers get (where credentials go)."""
    cfg = compose_cfg(
        [
            "tracking.uri=https://alice:tok-3141@mlflow.example.com",
            "+ray.runtime_env.env_vars.AWS_SECRET_ACCESS_KEY=sec-2718",
        ]
    )
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.create_experiment("e", artifact_location=(tmp_path / "artifacts").as_uri())
    store = runs.Store(client, client.tracking_uri, "e", experiment)
    job = Job(str(tmp_path), "e", ["tracking.uri=https://alice:tok-3141@mlflow.example.com"])
    run_id = tracking.Tracker.start(store, cfg, job, None, None).run_id
    run = client.get_run(run_id)
    assert run.data.params["tracking.uri"] == "https://alice:***@mlflow.example.com"
    assert run.data.params["ray.runtime_env.env_vars.AWS_SECRET_ACCESS_KEY"] == "***"
    assert run.data.tags[runs.OVERRIDES_TAG] == "tracking.uri=https://alice:***@mlflow.example.com"
    logged = tracking.logged_config(client, run_id)
    assert logged.tracking.uri == "https://alice:***@mlflow.example.com"
    assert logged.ray.runtime_env["env_vars"] == {"AWS_SECRET_ACCESS_KEY": "***"}
    assert logged.model == cfg.model  # what the predict stage rebuilds the model from
    stored = (tmp_path / "mlflow.db").read_bytes() + (tmp_path / "artifacts").joinpath(
        run_id, "artifacts", "config.yaml"
    ).read_bytes()
    assert b"tok-3141" not in stored and b"sec-2718" not in stored


def test_resume_reopens_an_unfinished_run_and_refuses_a_finished_one(tmp_path):
    """A driver that died (SIGKILL, a lost machine) leaves its run RUNNING; Ctrl-C leaves it KILLED."""
    import pytest

    from pipeline.errors import PipelineError

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.create_experiment("e", artifact_location=(tmp_path / "artifacts").as_uri())
    store = runs.Store(client, client.tracking_uri, "e", experiment)
    for status in ("RUNNING", "KILLED", "FAILED"):
        tags = {runs.STORAGE_TAG: f"/ckpt/{status}"}
        run_id = client.create_run(experiment, run_name=f"r-{status}", tags=tags).info.run_id
        if status != "RUNNING":
            runs.end_run(client, run_id, status, RuntimeError("stopped"))
        assert runs.reopen_run(store, f"r-{status}") == (run_id, f"/ckpt/{status}")
        reopened = client.get_run(run_id)
        assert reopened.info.status == "RUNNING" and runs.ERROR_TAG not in reopened.data.tags
    done = client.create_run(experiment, run_name="done", tags={runs.STORAGE_TAG: "/ckpt/done"}).info.run_id
    runs.end_run(client, done, "FINISHED")
    with pytest.raises(PipelineError, match="run 'done' .* already finished"):
        runs.reopen_run(store, "done")


def test_runs_are_found_by_names_and_paths_that_hold_quotes(tmp_path):
    """MLflow's filter strings have no escape character: names with ', " or both still match exactly."""
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.create_experiment('it\'s a "test"', artifact_location=(tmp_path / "artifacts").as_uri())
    names = ["plain", "it's", 'say "hi"', "both ' and \"", 'both _ and "']  # the last is a LIKE look-alike
    ids = {name: client.create_run(experiment, run_name=name).info.run_id for name in names}
    for name in names:
        assert [r.info.run_id for r in runs.runs_where(client, experiment, "run_name", name)] == [ids[name]]
    runs.end_run(client, ids["both ' and \""], "KILLED")
    client.set_tag(ids["both ' and \""], runs.STORAGE_TAG, "/ckpt/q")
    store = runs.Store(client, client.tracking_uri, "e", experiment)
    assert runs.reopen_run(store, "both ' and \"") == (ids["both ' and \""], "/ckpt/q")
    sweep_dir = str(tmp_path / 'it\'s "here"')
    parent = runs.sweep_parent(client, experiment, sweep_dir)
    assert runs.sweep_parent(client, experiment, sweep_dir) == parent  # found again, not created twice
