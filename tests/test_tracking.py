"""The tracking stage against a real MLflow store: what it writes, and what it must never write."""
from __future__ import annotations

from mlflow import MlflowClient
from omegaconf import OmegaConf

from conftest import compose_cfg
from pipeline import tracking


def test_passwords_in_uris_never_reach_mlflow(tmp_path):
    cfg = compose_cfg(["tracking.uri=https://alice:tok-3141@mlflow.example.com"])
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.create_experiment("e", artifact_location=(tmp_path / "artifacts").as_uri())
    run_id = tracking.start_run(client, experiment, None, None,
                                ["tracking.uri=https://alice:tok-3141@mlflow.example.com"], str(tmp_path))
    tracking.log_config(client, run_id, cfg, OmegaConf.to_yaml(cfg))
    run = client.get_run(run_id)
    assert run.data.params["tracking.uri"] == "https://alice:***@mlflow.example.com"
    assert run.data.tags[tracking.OVERRIDES_TAG] == "tracking.uri=https://alice:***@mlflow.example.com"
    logged = OmegaConf.load(client.download_artifacts(run_id, "config.yaml", str(tmp_path)))
    assert logged.tracking.uri == "https://alice:***@mlflow.example.com"
    assert b"tok-3141" not in (tmp_path / "mlflow.db").read_bytes()


def test_resume_reopens_an_unfinished_run_and_refuses_a_finished_one(tmp_path):
    """A driver that died (SIGKILL, a lost machine) leaves its run RUNNING; Ctrl-C leaves it KILLED."""
    import pytest

    from pipeline.config import PipelineError

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.create_experiment("e", artifact_location=(tmp_path / "artifacts").as_uri())
    for status in ("RUNNING", "KILLED", "FAILED"):
        tags = {tracking.STORAGE_TAG: f"/ckpt/{status}"}
        run_id = client.create_run(experiment, run_name=f"r-{status}", tags=tags).info.run_id
        if status != "RUNNING":
            tracking.end_run(client, run_id, status, RuntimeError("stopped"))
        assert tracking.reopen_run(client, experiment, f"r-{status}") == (run_id, f"/ckpt/{status}")
        reopened = client.get_run(run_id)
        assert reopened.info.status == "RUNNING" and tracking.ERROR_TAG not in reopened.data.tags
    done = client.create_run(experiment, run_name="done", tags={tracking.STORAGE_TAG: "/ckpt/done"}).info.run_id
    tracking.end_run(client, done, "FINISHED")
    with pytest.raises(PipelineError, match="run 'done' .* already finished"):
        tracking.reopen_run(client, experiment, "done")
