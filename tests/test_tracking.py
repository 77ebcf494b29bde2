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
