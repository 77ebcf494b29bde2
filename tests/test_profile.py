"""train.profile: rank 0's trace and operators for a few steps, Ray Data's stats of every epoch, as artifacts."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import in_process
from mlflow import MlflowClient


def test_a_profiled_run_logs_a_trace_perfetto_opens_its_operators_and_ray_datas_stats_of_each_epoch(
    tmp_path, ray_runtime, data_root, monkeypatch
):
    monkeypatch.setenv("PIPELINE_DATA_DIR", str(data_root))  # 512 training rows: 16 steps of 32
    profile = ["train.profile.enabled=true", "train.profile.wait=2", "train.profile.warmup=1", "train.profile.active=3"]
    in_process(
        tmp_path,
        "profiled",
        [*profile, "train.epochs=2", "ingest.batch_size=32", "ingest.cache=false", "tracking.log_model=false"],
    )
    client = MlflowClient(f"sqlite:///{tmp_path / 'outputs' / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("smoke").experiment_id])
    files = Path(client.download_artifacts(run.info.run_id, "profile", str(tmp_path)))
    assert sorted(p.name for p in files.iterdir()) == [
        "operators_epoch1.txt",
        "ray_data_epoch1.txt",
        "ray_data_epoch2.txt",
        "trace_epoch1.json",
    ]
    trace = json.loads((files / "trace_epoch1.json").read_text())  # Chrome's trace format, as Perfetto reads it
    steps = {event["name"] for event in trace["traceEvents"] if event.get("name", "").startswith("ProfilerStep#")}
    assert steps == {"ProfilerStep#3", "ProfilerStep#4", "ProfilerStep#5"}  # the 4th to 6th: 2 waited, 1 warmed up
    assert any(event.get("name") == "aten::mm" for event in trace["traceEvents"])  # the ViT's matrix products
    operators = (files / "operators_epoch1.txt").read_text()
    assert operators.startswith("epoch 1, steps 4-6\n") and "aten::mm" in operators and "Self CPU" in operators
    for epoch in (1, 2):  # each epoch's own pass: the 512 training rows read, stepped and split
        stats = (files / f"ray_data_epoch{epoch}.txt").read_text()
        assert "ReadEpochSource->MapBatches(Steps)" in stats and "512 total" in stats
