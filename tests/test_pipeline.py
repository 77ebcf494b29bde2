"""The pipeline end to end: real Ray, real MLflow store, real checkpoints, all under tmp_path."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import DETERMINISTIC, descendants, free_port, in_process, stand_in_command, write_split
from exported import best_model_exports
from mlflow import MlflowClient
from mlflow.entities import Run
from omegaconf import OmegaConf

from pipeline.common import startup
from pipeline.common.errors import PipelineError
from pipeline.training import checkpoint

# The README's quick start (cifar_vit_cpu) on the 512 generated training rows: 16 steps a worker an epoch
QUICK_START = ["+experiment=cifar_vit_cpu", "train.epochs=4", "ingest.batch_size=32"]
METRICS = ("train_loss", "val_loss", "val_accuracy", "train_throughput", "train_rows", "val_rows", "data_wait_fraction")


def cli_env(data_root: Path | str) -> dict[str, str]:
    """The environment a user's shell would give ``python -m pipeline``: data root set, default MLflow store."""
    env = {**os.environ, "PIPELINE_DATA_DIR": str(data_root)}
    env.pop("MLFLOW_TRACKING_URI", None)
    return env


def run_cli(args: list[str], cwd: Path, data_root: Path | str, no_proc: bool = False) -> subprocess.CompletedProcess:
    """``python -m pipeline ARGS``; ``no_proc``: with /proc unreadable to the liveness code, as on macOS."""
    return subprocess.run(
        stand_in_command(args, no_proc=True) if no_proc else [sys.executable, "-m", "pipeline", *args],
        cwd=cwd,
        env=cli_env(data_root),
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_startup_clock_starts_when_python_imports_the_pipeline_not_when_its_process_began():
    """A script's ``setup && python -m pipeline`` may exec python in the shell's own process, started
    before the setup: startup_s must not count the setup."""
    script = "import time, pipeline; print(time.time() - pipeline.STARTED_AT)"
    since = subprocess.run(
        ["sh", "-c", 'sleep 2 && exec "$0" -c "$1"', sys.executable, script], capture_output=True, text=True, check=True
    ).stdout
    assert 0.0 <= float(since) < 1.5


WATCH = ["tracking.log_every_n_steps=2", "tracking.system_metrics_s=1", "tracking.data_wait_warning=0"]


@dataclass
class CliRun:
    """One ``python -m pipeline +experiment=cifar_vit_cpu`` of four epochs, with /proc unreadable to the liveness
    code (standing in for macOS and Windows, where it does not exist), then ``stage=predict`` on its model."""

    root: Path
    output: str
    elapsed: float
    client: MlflowClient
    run: Run
    predict_output: str


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory, data_root) -> CliRun:
    root = tmp_path_factory.mktemp("cli")
    started = time.monotonic()
    result = run_cli([*QUICK_START, *WATCH, "hydra.run.dir=run"], root, data_root, no_proc=True)  # as on a Mac
    elapsed = time.monotonic() - started
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    client = MlflowClient(f"sqlite:///{root / 'outputs' / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("cifar_vit_cpu").experiment_id])
    predicted = run_cli(["+experiment=cifar_vit_cpu", "stage=predict", "hydra.run.dir=predict"], root, data_root)
    assert predicted.returncode == 0, predicted.stdout + predicted.stderr
    return CliRun(root, output, elapsed, client, run, predicted.stdout + predicted.stderr)


@pytest.mark.slow
def test_a_cli_run_finishes_with_our_lines_on_the_console(cli_run):
    assert "epoch 1/4  train_loss" in cli_run.output and "epoch 4/4  train_loss" in cli_run.output
    assert "RayTrainWorker pid=" not in cli_run.output and "Traceback" not in cli_run.output  # Ray's logs: files
    assert cli_run.run.info.status == "FINISHED"
    assert "mlflow.parentRunId" not in cli_run.run.data.tags  # a single run is not part of a sweep
    host, machine = cli_run.run.data.tags["pipeline.driver"].split(":")[0].split("#")
    assert machine == "?"  # no /proc: the driver names its host, no machine its pids could be looked up on


@pytest.mark.slow
def test_the_run_records_its_overrides_params_and_config(cli_run, data_root):
    run = cli_run.run
    assert run.data.tags["pipeline.overrides"] == " ".join([*QUICK_START, *WATCH])
    params = run.data.params
    assert params["model.hidden_dim"] == "128" and params["train.epochs"] == "4"
    assert params["model._target_"] == "torchvision.models.VisionTransformer"
    assert params["source.train"] == f"{data_root}/cifar10/train"
    artifacts = {a.path for a in cli_run.client.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "model", "learning_curve.png"} <= artifacts
    assert "profile" not in artifacts  # train.profile is off by default
    config = OmegaConf.load(cli_run.client.download_artifacts(run.info.run_id, "config.yaml", str(cli_run.root)))
    assert config.model.num_layers == 4 and config.train.epochs == 4


@pytest.mark.slow
def test_every_epoch_is_logged_once_with_the_figures_the_workers_reported(cli_run):
    run, client = cli_run.run, cli_run.client
    for metric in METRICS:
        history = client.get_metric_history(run.info.run_id, metric)
        assert sorted(m.step for m in history) == [0, 1, 2, 3], metric
    reports = [json.loads(line) for line in (cli_run.root / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["ranks"][0]["epoch"] for r in reports] == [0, 1, 2, 3]
    for metric in ("val_accuracy", "val_loss", "train_loss"):  # MLflow holds what rank 0 reported, exactly
        assert run.data.metrics[metric] == reports[-1]["ranks"][0][metric], metric
    assert run.data.metrics["val_rows"] == 256 and run.data.metrics["train_rows"] == 512
    first_step = client.get_metric_history(run.info.run_id, "startup_s")  # command to first training step
    assert [m.step for m in first_step] == [0] and 2.0 < first_step[0].value < cli_run.elapsed
    # between epochs: rank 0's batch loss every 2 steps (16 steps an epoch), at the global step
    steps = client.get_metric_history(run.info.run_id, "train_loss_step")
    assert sorted(m.step for m in steps) == list(range(2, 65, 2)) and all(0 < m.value < 10 for m in steps)


@pytest.mark.slow
def test_each_start_up_phase_is_logged_once_in_the_order_the_run_reaches_it_and_shown_on_the_console(cli_run):
    """Where the first minute went: each phase's end, from the command's start, the driver's and rank 0's, as
    ``system/startup_<phase>_s`` (each once, at step 0), never decreasing in the order of PHASES, the last one the
    run's startup_s; and the same figures in one console line once the first step is taken."""
    metrics = cli_run.run.data.metrics
    logged = {phase: metrics[startup.metric(phase)] for phase in startup.PHASES}  # every phase reached
    seconds = [logged[phase] for phase in startup.PHASES]
    assert (
        seconds[0] > 0 and seconds == sorted(seconds) and seconds[-1] == pytest.approx(metrics["startup_s"], abs=1e-3)
    )
    for phase in startup.PHASES:
        history = cli_run.client.get_metric_history(cli_run.run.info.run_id, startup.metric(phase))
        assert [m.step for m in history] == [0], phase
    (line,) = [line for line in cli_run.output.splitlines() if "start-up: sources" in line]
    assert f"first step {metrics['startup_s']:.1f} s" in line and f"ray up {logged['ray_up']:.1f} s" in line


@pytest.mark.slow
def test_ddp_replicas_stay_identical_and_agree_on_validation(cli_run):
    reports = [json.loads(line) for line in (cli_run.root / "run" / "metrics.jsonl").read_text().splitlines()]
    for report in reports:
        rank0, rank1 = report["ranks"]
        assert (rank0["rank"], rank1["rank"]) == (0, 1)
        assert rank0["weights_sha256"] == rank1["weights_sha256"]
        assert rank0["val_accuracy"] == rank1["val_accuracy"] and rank0["val_loss"] == rank1["val_loss"]


@pytest.mark.slow
def test_system_metrics_and_the_data_wait_are_recorded(cli_run):
    metrics, output = cli_run.run.data.metrics, cli_run.output
    assert 0.0 < metrics["data_wait_fraction"] < 1.0  # waited for some batches, not only waited
    assert 0 < metrics["system/cpu_utilization_percentage"] <= 100  # MLflow's own, once a second
    assert metrics["system/system_memory_usage_megabytes"] > 0
    # any wait is above a limit of 0: the console's epoch line and the run say so, naming the setting
    assert "above tracking.data_wait_warning=0" in output and "raise scaling.data_cpus" in output
    assert cli_run.run.data.tags["pipeline.data_wait"].startswith("epoch 4: data_wait ")


@pytest.mark.slow
def test_the_ingest_cache_holds_each_split_decoded_once(cli_run):
    metrics = cli_run.run.data.metrics
    assert "ingest: cached in Ray's object store: train 512 rows, 1.5 MiB in " in cli_run.output
    assert cli_run.run.data.tags["pipeline.cache"].startswith("cached in Ray's object store: train 512 rows")
    assert 512 * 3072 <= metrics["cache_train_mib"] * 2**20 < 512 * 3300
    assert 256 * 3072 <= metrics["cache_valid_mib"] * 2**20 < 256 * 3300
    assert 0 < metrics["cache_train_s"] < cli_run.elapsed


@pytest.mark.slow
def test_the_run_keeps_its_last_two_epochs_checkpoints_and_the_last_is_the_logged_model(cli_run):
    """``train.num_to_keep``'s default, 2, without a ``checkpoint_metric``: the latest two of the four epochs."""
    run, client = cli_run.run, cli_run.client
    logged = torch.load(
        client.download_artifacts(run.info.run_id, "model/state_dict.pt", str(cli_run.root)), weights_only=True
    )
    storage = cli_run.root / "run" / "checkpoints" / run.info.run_id  # each run's own, by its MLflow id
    assert run.data.tags["pipeline.storage"] == str(storage)
    checkpoints = sorted(storage.glob("checkpoint_*/checkpoint.pt"))
    assert [torch.load(c, weights_only=True)["epoch"] for c in checkpoints] == [2, 3]
    last = torch.load(checkpoints[-1], weights_only=True)
    assert {"model", "optimizer"} <= last.keys() and last["model"].keys() == logged.keys()
    assert all(torch.equal(last["model"][k], logged[k]) for k in logged)


@pytest.mark.slow
def test_predict_takes_the_newest_runs_model_and_matches_its_accuracy(cli_run):
    """The same weights on the same rows give the same accuracy; an MLflow run nested under the training run."""
    run, client = cli_run.run, cli_run.client
    for noise in ("will hang", "Progress bars disabled", "Traceback"):  # the console keeps to our lines
        assert noise not in cli_run.predict_output, noise
    (predicted,) = client.search_runs([run.info.experiment_id], filter_string="tags.`pipeline.stage` = 'predict'")
    assert predicted.info.status == "FINISHED" and predicted.info.run_name == f"predict: {run.info.run_name}"
    assert predicted.data.tags["mlflow.parentRunId"] == run.info.run_id
    table = pq.read_table(cli_run.root / "predict" / "predictions")
    assert table.column_names == ["path", "prediction", "confidence", "label"]
    accuracy = float((table["prediction"].to_numpy() == table["label"].to_numpy()).mean())
    assert predicted.data.metrics["predict_rows"] == table.num_rows == run.data.metrics["val_rows"] == 256
    assert predicted.data.metrics["predict_accuracy"] == pytest.approx(accuracy)
    assert accuracy == pytest.approx(run.data.metrics["val_accuracy"], abs=2 / 256)  # batch-size rounding


@pytest.mark.slow
def test_one_and_two_workers_agree_on_validation_of_the_same_weights(tmp_path, data_root, ray_runtime, monkeypatch):
    """lr=0 keeps the seeded initial weights, so both world sizes evaluate identical models on identical rows.
    The two-worker run asks for 3 epochs with early stopping: val_accuracy cannot improve, so both ranks
    stop after epoch 2, and the run ends FINISHED saying why, with its model."""
    monkeypatch.setenv("PIPELINE_DATA_DIR", str(data_root))
    common = ["optim.lr=0.0", "ingest.batch_size=64", "source.limit=null"]
    one, _ = in_process(tmp_path, "one", [*common, "scaling.num_workers=1"])
    stopping = ["train.epochs=3", "train.early_stop.patience=1"]
    two, run_dir = in_process(tmp_path, "two", [*common, "scaling.num_workers=2", *stopping])
    assert one["val_accuracy"] == two["val_accuracy"]
    assert one["val_loss"] == pytest.approx(two["val_loss"], rel=1e-6)
    reports = [json.loads(line)["ranks"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(reports) == 2  # epoch 2 of 3 was the last
    ranks = reports[-1]
    assert len(ranks) == 2 and ranks[0]["weights_sha256"] == ranks[1]["weights_sha256"]
    assert ranks[0]["stopped_early"] == ranks[1]["stopped_early"]
    client = MlflowClient(f"sqlite:///{tmp_path / 'outputs' / 'mlflow.db'}")
    (stopped,) = client.search_runs(
        [client.get_experiment_by_name("smoke").experiment_id], filter_string="tags.`pipeline.stopped_early` != ''"
    )
    assert stopped.info.status == "FINISHED" and stopped.data.tags["pipeline.stopped_early"] == (
        "after epoch 2 by train.early_stop: val_accuracy did not improve by more than 0 for 1 epoch(s) "
        f"(best {one['val_accuracy']:.4g} after epoch 1)"
    )
    assert "model" in {a.path for a in client.list_artifacts(stopped.info.run_id)}
    # lr=0 learned nothing: both runs say so, naming what a constant prediction scores
    for run_info in client.search_runs([client.get_experiment_by_name("smoke").experiment_id]):
        assert run_info.data.tags["pipeline.no_learning"].startswith(
            f"val_accuracy {one['val_accuracy']:.4g} is no better than always predicting the validation split's most"
        )
    assert leftover_actors() == []  # both jobs shared the runtime and left no training actors behind


@pytest.mark.slow
def test_a_one_worker_run_in_the_driver_records_what_a_worker_group_of_one_records(
    tmp_path, data_root, ray_runtime, monkeypatch
):
    """The same seeded one-worker job, in Ray Train's local mode (the worker is this process) and on a worker group:
    the same metrics, step losses, start-up phases and artifacts in MLflow, the same weights, and the same checkpoints
    kept (the best by val_loss and the latest, one taken within an epoch among them), each the run's model."""
    monkeypatch.setenv("PIPELINE_DATA_DIR", str(data_root))
    job = [
        *DETERMINISTIC,
        "train.epochs=2",
        "train.num_to_keep=1",
        "train.checkpoint_metric=val_loss",
        "train.checkpoint_every=20",
        "tracking.log_every_n_steps=4",
        "tracking.system_metrics_s=1",  # both runs outlast it
    ]
    runs = {}
    for name, local in (("driver", "true"), ("group", "false")):
        _, run_dir = in_process(tmp_path, name, [*job, f"scaling.local_mode={local}", f"tracking.run_name={name}"])
        client = MlflowClient(f"sqlite:///{tmp_path / 'outputs' / 'mlflow.db'}")
        (run,) = client.search_runs(
            [client.get_experiment_by_name("smoke").experiment_id], filter_string=f"tags.mlflow.runName = '{name}'"
        )
        (worker,) = [json.loads(line) for line in (run_dir / "workers.jsonl").read_text().splitlines()]
        reports = [json.loads(line)["ranks"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        storage = Path(run.data.tags["pipeline.storage"])
        kept = sorted(
            checkpoint.place(json.loads((c / "report.json").read_text()))
            for c in storage.glob("checkpoint_*")
            if c.is_dir()
        )
        history = {
            key: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]
            for key in ("train_loss", "val_loss", "val_accuracy", "train_rows", "train_loss_step", "checkpoint_step")
        }
        artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
        runs[name] = (run, worker, reports, kept, history, artifacts)
    (local_run, in_driver, local_reports, *local_rest), (group_run, in_group, group_reports, *group_rest) = (
        runs.values()
    )
    assert in_driver["pid"] == os.getpid() and in_group["pid"] != os.getpid()
    assert local_run.info.status == group_run.info.status == "FINISHED"
    assert set(local_run.data.metrics) == set(group_run.data.metrics)  # start-up phases and system metrics too
    assert [r[0]["weights_sha256"] for r in local_reports] == [r[0]["weights_sha256"] for r in group_reports]
    assert local_rest == group_rest  # the checkpoints kept, the metric histories, the artifacts
    kept, history, _ = local_rest
    assert kept[-1] == (1, 1, 0) and all(step == 0 for _, _, step in kept)  # those within an epoch (unscored) went
    assert len(history["train_loss_step"]) == 16 and len(history["checkpoint_step"]) == 3


@pytest.mark.slow
def test_the_quick_start_recipe_learns(cli_run):
    """On learnable generated data (each image's brightness follows its label), the quick-start
    experiment's recipe (cifar_vit_cpu: one-cycle schedule, two single-threaded DDP workers, flips)
    lowers the training loss and beats chance (0.1) on validation by a clear margin."""
    run, client = cli_run.run, cli_run.client
    losses = [m.value for m in sorted(client.get_metric_history(run.info.run_id, "train_loss"), key=lambda m: m.step)]
    assert len(losses) == 4 and losses[-1] < 0.7 * losses[0], losses
    assert run.data.metrics["val_accuracy"] >= 0.4, run.data.metrics
    assert "pipeline.no_learning" not in run.data.tags


def leftover_actors(timeout_s: float = 30.0) -> list[str]:
    """Processes of this pipeline's actors still alive on pytest's own runtime (Ray titles them
    ray::ClassName...; its raylet and their processes descend from pytest's)."""
    names = ("RayTrainWorker", "TrainController", "_QueueActor", "SplitCoordinator")
    deadline = time.monotonic() + timeout_s
    while True:
        alive = []
        for process in descendants(os.getpid()):
            with contextlib.suppress(psutil.Error):  # the process ended while we looked
                title = " ".join(process.cmdline())
                alive += [title for name in names if title.startswith(f"ray::{name}")]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(1)


def data_with_a_bad_jpeg(root: Path, row: int = 5, rows: int = 32) -> Path:
    """CIFAR-like splits whose valid ``row`` (of ``rows``) holds bytes that are not a JPEG."""
    write_split(root / "cifar10" / "train", 64, 1, seed=3)
    write_split(root / "cifar10" / "test", rows, 1, seed=4)
    table = pq.read_table(root / "cifar10" / "test" / "part-00000.parquet")
    images = table.column("image").to_pylist()
    images[row] = b"\xff\xd8 this is not a JPEG"
    table = table.set_column(0, "image", pa.array(images, pa.binary()))
    pq.write_table(table, root / "cifar10" / "test" / "part-00000.parquet")
    return root


def test_a_bad_row_among_the_first_fails_before_anything_is_recorded(tmp_path, ray_runtime, monkeypatch):
    """ingest.cache sizes itself by running the first rows through the steps that run once, on the driver:
    a bad row among them is named there, before an MLflow run exists."""
    monkeypatch.setenv("PIPELINE_DATA_DIR", str(data_with_a_bad_jpeg(tmp_path / "data")))
    with pytest.raises(
        PipelineError,
        match=r"^transforms.valid: ValueError: decode_image: column 'image' row 5 of "
        r".*/cifar10/test/part-00000.parquet holds b.*not an image that decodes \(ValueError: not a known image format",
    ):
        in_process(tmp_path, "broken", ["source.limit=null", "scaling.num_workers=2"])
    assert no_runs_logged(tmp_path)


@pytest.mark.slow
def test_a_failing_worker_marks_the_run_failed(tmp_path, ray_runtime, monkeypatch):
    """A bad row past the first ones (the cache's size estimate reads 32) fails in training: on the rank
    whose batch held it, or on both when the other's iterator meets the failed read first."""
    monkeypatch.setenv("PIPELINE_DATA_DIR", str(data_with_a_bad_jpeg(tmp_path / "data", row=40, rows=64)))
    with pytest.raises(
        PipelineError,
        match=r"training failed on rank\(s\) \[(0|1|0, 1)\]: .*'image' row 40 of "
        r".*/cifar10/test/part-00000.parquet holds b.*not an image that decodes \(ValueError: not a known image format",
    ):
        in_process(tmp_path, "broken", ["source.limit=null", "scaling.num_workers=2"])
    client = MlflowClient(f"sqlite:///{tmp_path / 'outputs' / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("smoke").experiment_id])
    assert [r.info.status for r in runs] == ["FAILED"]


@pytest.mark.slow
def test_a_diverging_run_fails_naming_the_epoch_and_batch_and_logs_no_nan(
    tmp_path, data_root, ray_runtime, monkeypatch
):
    """lr=1e9: the gradients become NaN or inf within the first epoch; the run fails there, naming the step and
    what to change, and MLflow holds a FAILED run with no NaN metric and no model."""
    monkeypatch.setenv("PIPELINE_DATA_DIR", str(data_root))
    with pytest.raises(
        PipelineError,
        match=r"training failed in this process \(Ray Train's local mode\): FloatingPointError: the loss became NaN "
        r"or inf at epoch 1, batch \d+: .*Lower optim.lr, clip the gradients with train.grad_clip, or skip such "
        r"steps.* \(raised at .*worker.py:\d+, in train_epoch\)",
    ):
        in_process(tmp_path, "diverging", ["optim.lr=1e9", "scaling.num_workers=1"])
    client = MlflowClient(f"sqlite:///{tmp_path / 'outputs' / 'mlflow.db'}")
    (failed,) = client.search_runs([client.get_experiment_by_name("smoke").experiment_id])
    assert failed.info.status == "FAILED" and "FloatingPointError" in failed.data.tags["pipeline.error"]
    assert all(value == value for value in failed.data.metrics.values())  # no NaN
    assert "model" not in {a.path for a in client.list_artifacts(failed.info.run_id)}


@pytest.mark.slow
def test_skipped_rows_are_counted_in_mlflow(tmp_path, ray_runtime, monkeypatch):
    monkeypatch.setenv("PIPELINE_DATA_DIR", str(data_with_a_bad_jpeg(tmp_path / "data")))
    metrics, _ = in_process(
        tmp_path, "skipping", ["source.limit=null", "scaling.num_workers=1", "transforms.valid.decode.fn.on_error=skip"]
    )
    assert metrics["val_rows"] == 31 and metrics["train_rows"] == 64
    client = MlflowClient(f"sqlite:///{tmp_path / 'outputs' / 'mlflow.db'}")
    (run_info,) = client.search_runs([client.get_experiment_by_name("smoke").experiment_id])
    assert run_info.info.status == "FINISHED" and run_info.data.metrics["skipped_rows"] == 1


def no_runs_logged(tmp_path: Path) -> bool:
    """No store at all, or (an error found once Ray is up; the store opens while Ray starts) a store
    holding no run and no experiment but MLflow's own Default."""
    store = tmp_path / "outputs" / "mlflow.db"
    if not store.exists():
        return True
    client = MlflowClient(f"sqlite:///{store}")
    experiments = client.search_experiments()
    return [e.name for e in experiments] == ["Default"] and not client.search_runs(
        [e.experiment_id for e in experiments]
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["+experiment=nope"], "experiment has no option 'nope'"),
        (["+experiment=smoke", "train.epochs=abc"], "train.epochs: expected an integer, got 'abc'"),
        (["+experiment=smoke", "train.epoch=2"], "train has no key 'epoch'. Did you mean epochs?"),
        (["+experiment=smoke", "scheduler=null"], "Write ~scheduler"),
        (["+experiment=smoke", "optim.lr=fast"], "optim.lr: expected a float or a Tensor, got 'fast'"),
    ],
)
def test_a_command_line_mistake_is_one_paragraph_before_ray_starts(tmp_path, data_root, args, message):
    result = run_cli(args, tmp_path, data_root)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert message in output
    assert len(output.strip().splitlines()) == 1, output  # nothing but the paragraph: no traceback, no Ray
    assert no_runs_logged(tmp_path)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["+model.depth=3"], "model: torchvision.models.VisionTransformer does not accept"),
        (
            ["tracking.uri=http://127.0.0.1:{port}"],
            "tracking.uri: no MLflow tracking server answers at http://127.0.0.1",
        ),
    ],
)
def test_checks_of_parts_and_the_store_fail_before_anything_is_recorded(
    tmp_path, data_root, ray_runtime, monkeypatch, overrides, message
):
    """The _target_ imports are checked before Ray starts, the MLflow store while it starts (here, on the
    running shared runtime): a PipelineError, which the command prints as one paragraph with exit status 1
    (the cases above and below show that), and no run anywhere."""
    monkeypatch.setenv("PIPELINE_DATA_DIR", str(data_root))
    port = free_port()  # nothing listens there
    with pytest.raises(PipelineError) as error:
        in_process(tmp_path, "run", [o.format(port=port) for o in overrides])
    assert message in str(error.value)
    assert no_runs_logged(tmp_path)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["ray.address=127.0.0.1:{port}"], "ray.address: cannot reach a Ray cluster at '127.0.0.1:{port}'"),
        (["transforms.valid.decode.fn.on_error=ignore"], "on_error: expected one of 'raise', 'skip', got 'ignore'"),
    ],
)
def test_unreachable_services_and_bad_arguments_fail_in_one_paragraph(tmp_path, data_root, overrides, message):
    port = free_port()  # nothing listens there
    result = run_cli(["+experiment=smoke", *(o.format(port=port) for o in overrides)], tmp_path, data_root)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert message.format(port=port) in output and "Traceback" not in output
    if "on_error" in message:  # checked with the config, before Ray starts
        assert "Ray runtime up" not in output
    assert no_runs_logged(tmp_path)


def test_missing_data_fails_with_advice(tmp_path):
    result = run_cli(["+experiment=smoke", "source.download=null"], tmp_path, tmp_path / "empty")
    output = result.stdout + result.stderr
    assert result.returncode == 1
    assert "source.train: no parquet files" in output and "PIPELINE_DATA_DIR" in output
    assert "Traceback" not in output
    assert no_runs_logged(tmp_path)


def test_missing_column_fails_naming_file_and_column(tmp_path):
    write_split(tmp_path / "data" / "cifar10" / "train", 16, 1, seed=0, columns=("image",))
    write_split(tmp_path / "data" / "cifar10" / "test", 16, 1, seed=0)
    result = run_cli(["+experiment=smoke"], tmp_path, tmp_path / "data")
    assert result.returncode == 1
    assert "has no column 'label' (it has image)" in result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert no_runs_logged(tmp_path)


# A notebook's session, in a plain Python process outside the repo: train, predict over the run's validation rows
# and over rows in memory, evaluate, and a mistake; what it saw, as JSON
FROM_PYTHON = """
import json, sys
import pyarrow.parquet as pq
import pipeline
from pipeline.common.errors import PipelineError

result = pipeline.train("smoke", ["train.epochs=1", "scaling.num_workers=1", "train.export=[torch_export,onnx]"])
frame = pipeline.predict(result.model_uri)
rows = pq.read_table(sys.argv[1]).slice(0, 20).to_pandas()
in_memory = pipeline.predict(result.run_id, rows)
evaluated = pipeline.evaluate(result.run_id)
try:
    pipeline.predict("no-such-run")
except PipelineError as err:
    mistake = str(err)
print(json.dumps({
    "run_id": result.run_id, "metrics": result.metrics, "model_uri": result.model_uri, "columns": list(frame.columns),
    "accuracy": float((frame["prediction"] == frame["label"]).mean()), "rows": len(frame),
    "predicted": frame.attrs["run_id"], "in_memory": in_memory["label"].tolist(), "labels": rows["label"].tolist(),
    "evaluated": evaluated.run_id, "evaluation": evaluated.metrics, "mistake": mistake,
}))
"""


@pytest.mark.slow
def test_from_a_python_process_a_run_trains_predicts_its_validation_accuracy_evaluates_and_exports(
    tmp_path, data_root, monkeypatch
):
    """The notebook's way in (``pipeline.train``, ``predict``, ``evaluate``), in a plain Python process outside the
    repo: the run, its last epoch's metrics and its best model, which MLflow alone loads; predictions whose accuracy
    is the run's val_accuracy, in the rows' order for rows in memory; an evaluation nested under the run with its
    confusion matrix; and the ViT's exported files matching the eager model in a process without this repo."""
    import mlflow.pytorch

    import pipeline

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = {**cli_env(data_root), "MLFLOW_TRACKING_URI": uri}  # a notebook's store
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)  # where MLflow loads the model from, here
    valid = data_root / "cifar10" / "test" / "part-00000.parquet"
    completed = subprocess.run(
        [sys.executable, "-c", FROM_PYTHON, str(valid)], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    seen = json.loads(completed.stdout.splitlines()[-1])
    client = MlflowClient(uri)
    run = client.get_run(seen["run_id"])
    assert (
        run.info.status == "FINISHED" and run.info.experiment_id == client.get_experiment_by_name("smoke").experiment_id
    )
    assert {k: run.data.metrics[k] for k in ("train_loss", "val_loss", "val_accuracy")} == {
        k: seen["metrics"][k] for k in ("train_loss", "val_loss", "val_accuracy")
    }
    assert run.data.params["train.epochs"] == "1" and "train.epochs=1" in run.data.tags["pipeline.overrides"]
    assert seen["model_uri"] == f"models:/{run.data.tags['pipeline.model_id']}"
    model = mlflow.pytorch.load_model(seen["model_uri"], map_location="cpu")
    assert model(torch.zeros(2, 3, 32, 32, dtype=torch.uint8)).shape == (2, 10)

    # predict: every validation row, its accuracy the run's; rows in memory come back in their order
    assert seen["rows"] == run.data.metrics["val_rows"] == 256
    assert seen["accuracy"] == run.data.metrics["val_accuracy"]
    assert {"path", "prediction", "confidence", "label"} <= set(seen["columns"])
    assert seen["in_memory"] == seen["labels"] and len(set(seen["labels"])) > 1
    predicted = client.get_run(seen["predicted"])
    assert predicted.data.tags["mlflow.parentRunId"] == run.info.run_id
    assert predicted.data.metrics["predict_accuracy"] == run.data.metrics["val_accuracy"]

    # evaluate: nested under the run, its confusion matrix and per-class table, as the command line makes them
    evaluated = client.get_run(seen["evaluated"])
    assert evaluated.data.tags["mlflow.parentRunId"] == run.info.run_id
    assert evaluated.data.tags["pipeline.stage"] == "evaluate" and evaluated.info.run_name.startswith("evaluate: ")
    assert {"confusion_matrix.png", "per_class.json"} <= {a.path for a in client.list_artifacts(evaluated.info.run_id)}
    assert seen["evaluation"]["predict_accuracy"] == run.data.metrics["val_accuracy"]
    assert "'no-such-run' is neither a run id nor an MLflow model URI" in seen["mistake"]

    # train.export: both files load without this repo and match the eager ViT on 64 held-out rows
    checked, manifest = best_model_exports(client, run.info.run_id, tmp_path)
    assert set(checked) == {"torch_export", "onnx"} and all(within for _, within in checked.values()), checked
    assert manifest["checked"]["rows"] == 64 and manifest["input"] == {
        "column": "image",
        "dtype": "uint8",
        "shape": ["batch", 3, 32, 32],
    }
    assert manifest["scaling_inside"]["normalize"]["mean"] == [0.5, 0.5, 0.5]
    assert "torch_export: model.pt2: max |diff|" in run.data.tags["pipeline.export"]

    with pytest.raises(PipelineError, match="train.epoch=1: train has no key 'epoch'"):
        pipeline.train("smoke", ["train.epoch=1"])
