"""Canaries: each pins a behaviour of Ray (2.60) that a workaround in ``pipeline/common/workarounds.py`` exists
for. When one fails, Ray has changed: revisit the workaround it names, then the canary."""

from __future__ import annotations

import logging
import os
import queue
import signal
import sys
import threading
from pathlib import Path

import numpy as np
import pyarrow.fs as pafs
import pytest
import ray
import ray.cloudpickle
import ray.data
import ray.train
from ray.train.torch import TorchTrainer
from ray.util.placement_group import PlacementGroup

from pipeline.common.errors import root_cause
from pipeline.common.workarounds import (
    STREAMED_BLOCK_BYTES,
    quiet_tune_state_upload_race,
    release_placement_group,
    streamed_blocks,
)
from pipeline.runtime.filesystems import RunStorage
from pipeline.training import checkpoint
from pipeline.training.local_mode import LocalReports
from pipeline.training.trainer import explain, kept_checkpoints


def read_a_bad_row(config: dict) -> None:
    """A training loop whose data holds a row its transform rejects, as a corrupt image would be."""
    for _ in ray.train.get_dataset_shard("train").iter_batches(batch_size=4):
        pass


def reject_row_7(batch: dict) -> dict:
    if 7 in batch["id"]:
        raise TypeError("row 7 holds None, not JPEG bytes")
    return batch


@pytest.mark.slow
def test_fit_on_the_main_thread_installs_a_sigint_handler_and_worker_errors_arrive_as_traceback_text(
    ray_runtime, tmp_path
):
    """Workarounds: ``fit_off_main_thread`` (Ray Train's own SIGINT handler, installed by ``fit()`` on
    the main thread and left there) and ``root_cause`` (a user error inside a Ray Data task inside a
    worker reaches the driver as traceback text whose last ``Type: message`` line is the user's)."""
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray's workers cannot import tests/
    ours = signal.getsignal(signal.SIGINT)
    trainer = TorchTrainer(
        read_a_bad_row,
        scaling_config=ray.train.ScalingConfig(num_workers=1, resources_per_worker={"CPU": 0.5}),
        datasets={"train": ray.data.range(16, override_num_blocks=2).map_batches(reject_row_7)},
        run_config=ray.train.RunConfig(storage_path=str(tmp_path), name="canary"),
    )
    try:
        with pytest.raises(ray.train.WorkerGroupError) as failed:
            trainer.fit()
        installed = signal.getsignal(signal.SIGINT)
    finally:
        signal.signal(signal.SIGINT, ours)
    assert installed is not ours, "Ray Train no longer installs a SIGINT handler: fit_off_main_thread may go"
    (failure,) = failed.value.worker_failures.values()
    assert str(failure).strip() != root_cause(failure)  # wrapped in Ray's text: root_cause still needed
    assert root_cause(failure) == "TypeError: row 7 holds None, not JPEG bytes"
    assert "training failed on rank(s) [0]: TypeError: row 7 holds None" in str(explain(failed.value))


def test_a_controller_failure_is_explained_by_its_cause():
    err = ray.train.ControllerError(OSError("checkpoint_manager_snapshot.json: read-only file system"))
    assert str(explain(err)).startswith(
        "training failed in Ray Train's controller: OSError: checkpoint_manager_snapshot.json: read-only file system"
    )


def test_the_controller_settings_a_local_runtime_changes_are_still_read_from_these_variables():
    """Workaround: ``local_runtime_settings`` turns the preemption watcher off and shortens the
    controller's polling by these variables' names; Ray reads them in its controller, with these defaults."""
    from ray.train.v2._internal import constants  # private on purpose: this test watches it

    assert constants.ENABLE_PREEMPTION_WATCHER_ENV_VAR == "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"
    assert constants.DEFAULT_ENABLE_PREEMPTION_WATCHER is True
    assert constants.HEALTH_CHECK_INTERVAL_S_ENV_VAR == "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"
    assert constants.DEFAULT_HEALTH_CHECK_INTERVAL_S == 2.0


AFTER_SHUTDOWN = """
import ray
ray.init(num_cpus=1, include_dashboard=False)
ray.shutdown()
try:
    ray.put(1)
except Exception as err:
    print("raised", type(err).__name__)
print("initialized", ray.is_initialized())
ray.shutdown()
"""


@pytest.mark.slow  # starts Ray
@pytest.mark.parametrize("auto_connect", ["", "0"])
def test_a_ray_call_after_shutdown_starts_a_new_runtime_unless_auto_connect_is_off(auto_connect):
    """Workaround: ``pipeline/__main__.py`` sets RAY_ENABLE_AUTO_CONNECT=0 before Ray is imported: by default a call
    after ``ray.shutdown`` starts a new local runtime (what held a failed command forever); with it off, it raises."""
    import subprocess

    env = {**os.environ, "RAY_ENABLE_AUTO_CONNECT": auto_connect}
    env.pop("RAY_ADDRESS", None)  # a team's cluster exported: this is about a local runtime
    done = subprocess.run([sys.executable, "-c", AFTER_SHUTDOWN], env=env, capture_output=True, text=True, timeout=120)
    expected = "initialized True\n" if auto_connect == "" else "raised RaySystemError\ninitialized False\n"
    assert done.stdout == expected, done.stdout + done.stderr[-2000:]


def test_shutdown_kills_a_slow_raylet_after_a_second_and_its_agents_report_its_end_for_a_minute():
    """Workaround: ``end_agents_at_exit``. ``ray.shutdown`` gives each process it started 1 s after SIGTERM
    before SIGKILL (a raylet on a loaded machine needs longer), and an agent that finds its raylet gone
    without a graceful end reports it to the GCS with a 60 s timeout before it exits."""
    import inspect

    from ray._private import node, process_watcher, utils  # private on purpose: this test watches them

    assert "wait_timeout_seconds = 1\n" in inspect.getsource(node.Node._kill_process_impl)
    assert "report_raylet_error_logs(log_dir, gcs_client)" in inspect.getsource(process_watcher._check_parent)
    assert "publish_error_to_driver(" in inspect.getsource(process_watcher.report_raylet_error_logs)
    assert "message, job_id, 60)" in inspect.getsource(utils.publish_error_to_driver)


def report_worsening_checkpoints(config: dict) -> None:
    """Three epochs, each with a checkpoint scoring worse than the last."""
    import tempfile

    for epoch, score in enumerate((0.9, 0.5, 0.1)):
        with tempfile.TemporaryDirectory() as tmp:
            with open(os.path.join(tmp, "epoch.txt"), "w") as out:
                out.write(str(epoch))
            ray.train.report({"epoch": epoch, "score": score}, checkpoint=ray.train.Checkpoint.from_directory(tmp))


class Told(ray.train.UserCallback):
    """A Ray Train callback that leaves a file at ``path`` when a report reaches it."""

    def __init__(self, path: str):
        self.path = path

    def after_report(self, run_context, metrics: list[dict], checkpoint) -> None:
        Path(self.path).touch()


@pytest.mark.slow
def test_ray_keeps_the_best_checkpoint_and_the_latest_lists_the_best_alone_and_in_local_mode_keeps_none(
    ray_runtime, tmp_path
):
    """Workarounds: ``kept_checkpoints``: with num_to_keep=1, Ray Train keeps the best checkpoint and the latest on
    storage, but ``Result.best_checkpoints`` lists the best alone. ``pipeline.training.local_mode``: in Ray Train's
    local mode (num_workers=0) the same reports leave nothing in storage, no callback runs and the Result has no
    path; ``LocalReports`` persists them and keeps the checkpoints Ray keeps."""
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    keeping = ray.train.CheckpointConfig(
        num_to_keep=1, checkpoint_score_attribute="score", checkpoint_score_order="max"
    )
    result = TorchTrainer(
        report_worsening_checkpoints,
        scaling_config=ray.train.ScalingConfig(num_workers=1, resources_per_worker={"CPU": 0.5}),
        run_config=ray.train.RunConfig(storage_path=str(tmp_path), name="kept", checkpoint_config=keeping),
    ).fit()
    on_storage = {str(path) for path in (tmp_path / "kept").glob("checkpoint_*") if path.is_dir()}
    assert {(Path(path) / "epoch.txt").read_text() for path in on_storage} == {"0", "2"}  # the best, the latest
    listed = {checkpoint.path for checkpoint, _ in result.best_checkpoints}
    assert len(listed) == 1 and result.checkpoint.path not in listed, (
        "best_checkpoints now lists the latest checkpoint too: kept_checkpoints may go"
    )
    assert kept_checkpoints(result, RunStorage(str(tmp_path), "kept", pafs.LocalFileSystem(), "")) == on_storage

    local = TorchTrainer(
        report_worsening_checkpoints,
        scaling_config=ray.train.ScalingConfig(num_workers=0),
        run_config=ray.train.RunConfig(
            storage_path=str(tmp_path),
            name="local",
            checkpoint_config=keeping,
            callbacks=[Told(str(tmp_path / "told"))],
        ),
    ).fit()
    assert local.path is None and not local.best_checkpoints, "local mode now keeps a record: revisit local_mode.py"
    assert not (tmp_path / "local").exists() and not (tmp_path / "told").exists(), "local mode persists now"

    events = queue.SimpleQueue()
    ours = RunStorage(str(tmp_path), "ours", pafs.LocalFileSystem(), "")
    reports = LocalReports(storage=ours, num_to_keep=1, metric="score", mode="max", events=events)
    for epoch, score in enumerate((0.9, 0.5, 0.1)):
        directory = tmp_path / f"written-{epoch}"
        directory.mkdir()
        checkpoint.write_report(str(directory), {"epoch": epoch, "score": score}, {})
        reports.persist(str(directory), {"epoch": epoch, "score": score})
        assert not directory.exists()  # the local copy goes, as Ray Train's does
    kept = checkpoint.reports(pafs.LocalFileSystem(), str(tmp_path / "ours"))
    assert [report["epoch"] for _, report in kept] == [0, 2]
    relayed = [events.get() for _ in range(3)]
    assert [event.ranks[0]["epoch"] for event in relayed] == [0, 1, 2]
    assert [relayed[0].checkpoint, relayed[2].checkpoint] == [path for path, _ in kept]


def report_epochs_forever(config: dict) -> None:
    group = ray.util.get_current_placement_group().id.hex()
    for epoch in range(1000):
        ray.train.report({"epoch": epoch, "placement_group": group})


def train_in_a_trial(config: dict) -> None:
    """A Tune trial's body as in ``pipeline/jobs/trial.py``: a TorchTrainer reporting to Tune."""
    from ray import tune
    from ray.tune.integration.ray_train import TuneReportCallback

    TorchTrainer(
        report_epochs_forever,
        scaling_config=ray.train.ScalingConfig(num_workers=1, resources_per_worker={"CPU": 0.5}),
        run_config=ray.train.RunConfig(
            storage_path=config["storage"], name=tune.get_context().get_trial_id(), callbacks=[TuneReportCallback()]
        ),
    ).fit()


@pytest.mark.slow
def test_a_tune_trial_stopped_early_leaves_its_training_placement_group_behind(ray_runtime, tmp_path):
    """Workaround: ``release_placement_group`` (a trial that Tune stops, as ASHA does, ends before
    Ray Train removes its workers' placement group; without the dashboard nothing removes it)."""
    from ray import tune

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    results = tune.Tuner(
        tune.with_resources(train_in_a_trial, {"CPU": 0.01}),
        param_space={"storage": str(tmp_path / "train")},
        run_config=tune.RunConfig(storage_path=str(tmp_path / "tune"), stop={"epoch": 1}, verbose=0),
    ).fit()
    group_id = results[0].metrics["placement_group"]
    group = PlacementGroup(ray.PlacementGroupID(bytes.fromhex(group_id)))
    assert ray.util.placement_group_table(group)["state"] == "CREATED", (
        "Ray now removes a stopped trial's placement group: release_placement_group may go"
    )
    release_placement_group(group_id)
    assert ray.util.placement_group_table(group)["state"] == "REMOVED"


def test_a_version_of_a_logged_model_is_looked_up_in_the_global_tracking_store(tmp_path, monkeypatch):
    """Workaround: ``global_tracking_uri``. MLflow's SQL registry finds a ``models:/MODEL_ID`` source in
    the global tracking URI's store, not the calling client's; the workaround sets it for the call and
    puts ``MLFLOW_TRACKING_URI`` back."""
    import mlflow
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    from pipeline.common.workarounds import global_tracking_uri

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'elsewhere.db'}")
    mlflow.set_tracking_uri(None)  # as a fresh process: the variable decides
    ours = f"sqlite:///{tmp_path / 'ours.db'}"
    client = MlflowClient(ours)
    model = client.create_logged_model(client.create_experiment("canary"), name="m")
    client.create_registered_model("m")
    with pytest.raises(MlflowException, match=f"Logged model with ID '{model.model_id}' not found"):
        client.create_model_version("m", source=f"models:/{model.model_id}", model_id=model.model_id)
    with global_tracking_uri(ours):
        version = client.create_model_version("m", source=f"models:/{model.model_id}", model_id=model.model_id)
    try:
        assert version.source == f"models:/{model.model_id}"
        assert os.environ["MLFLOW_TRACKING_URI"] == f"sqlite:///{tmp_path / 'elsewhere.db'}"  # put back
    finally:
        mlflow.set_tracking_uri(None)


ABORTED_AFTER_SIGTERM = """
import os, signal, sys, time


def ours(signum, frame):
    raise SystemExit(143)


signal.signal(signal.SIGTERM, ours)
import ray

ray.init(address="local", num_cpus=1, include_dashboard=False)  # its own runtime, never another test's
print("replaced" if signal.getsignal(signal.SIGTERM) is not ours else "kept", flush=True)
if sys.argv[1] == "put back":
    signal.signal(signal.SIGTERM, ours)
try:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(10)
except SystemExit:
    time.sleep(4)  # a cleanup longer than Ray's alarm
    print("cleaned up", flush=True)
"""


@pytest.mark.slow  # starts Ray in a subprocess
@pytest.mark.parametrize("handler", ["Ray's", "put back"])
def test_ray_init_replaces_the_sigterm_handler_with_one_that_aborts_a_slow_cleanup_after_3_s(handler):
    """Workaround: ``own_sigterm_handler``. After ``ray.init``, a SIGTERM goes to Ray's failure handler
    (a stack trace, and an alarm that aborts the process 3 s later), then to its ``sys.exit``; the
    process's own handler, put back, replaces both."""
    import subprocess

    done = subprocess.run([sys.executable, "-c", ABORTED_AFTER_SIGTERM, handler], capture_output=True, text=True)
    assert "replaced" in done.stdout
    if handler == "Ray's":
        assert done.returncode == -signal.SIGABRT and "cleaned up" not in done.stdout, done.stderr[-2000:]
        assert "SIGTERM received" in done.stderr
    else:
        assert done.returncode == 0 and "cleaned up" in done.stdout, done.stderr[-2000:]
        assert "SIGTERM received" not in done.stderr


@pytest.mark.parametrize("how", ["import mlflow.pytorch", "pipeline.common.workarounds.import_mlflow_pytorch()"])
def test_importing_mlflow_pytorch_silences_warnings_unless_the_root_logger_is_put_back(how):
    """Workaround: ``import_mlflow_pytorch``. MLflow's import sets the root logger to ERROR."""
    import subprocess

    code = f"import logging, pipeline.common.workarounds\n{how}\nprint(logging.getLogger().level)"
    level = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()[-1]
    assert int(level) == (logging.ERROR if how.startswith("import") else logging.WARNING)


def test_tune_writes_its_experiment_state_while_its_last_upload_of_it_still_runs(ray_runtime, tmp_path, monkeypatch):
    """Workaround: ``quiet_tune_state_upload_race`` (an upload that lists one of Tune's temp files before
    its rename fails, and Tune logs that as an error). The upload is held until the next save has run."""
    from ray.train._internal import storage as ray_storage
    from ray.tune.execution.experiment_state import _ExperimentCheckpointManager

    copy, uploading, release = ray_storage._pyarrow_fs_copy_files, threading.Event(), threading.Event()

    def held_copy(*args, **kwargs):
        uploading.set()
        release.wait(timeout=10)  # only a Ray that waited for this upload before saving waits this long
        try:
            return copy(*args, **kwargs)
        finally:
            uploading.clear()

    monkeypatch.setattr(ray_storage, "_pyarrow_fs_copy_files", held_copy)
    storage = ray_storage.StorageContext(str(tmp_path / "storage"), "canary")
    manager = _ExperimentCheckpointManager(storage=storage, checkpoint_period=0)
    staging = Path(storage.experiment_driver_staging_path)

    def save() -> None:
        staging.mkdir(parents=True, exist_ok=True)
        (staging / "state.json").write_text("{}")

    manager.sync_up_experiment_state(save)
    assert uploading.wait(timeout=30)
    saved_during_upload = []
    manager.sync_up_experiment_state(lambda: saved_during_upload.append(uploading.is_set()))
    release.set()
    manager.sync_up_experiment_state(save, force=True, wait=True)
    assert saved_during_upload == [True], "Tune now waits for its last upload before saving: the filter may go"
    assert (tmp_path / "storage" / "canary" / "state.json").read_text() == "{}"


@pytest.mark.parametrize(
    ("error", "shown"),
    [
        (
            FileNotFoundError("Failed to open local file '/tmp/x/.1cc92c09-91dc-4524-a5eb-8cdea84a7f34-tmp-a.json'"),
            False,
        ),
        (FileNotFoundError("Failed to open local file '/tmp/x/experiment_state.json'"), True),
        (PermissionError("Failed to open local file '/tmp/x/.1cc92c09-91dc-4524-a5eb-8cdea84a7f34-tmp-a.json'"), True),
    ],
)
def test_only_tunes_error_for_a_renamed_temp_file_is_kept_off_the_console(error, shown, caplog):
    quiet_tune_state_upload_race()
    logger = logging.getLogger("ray.tune.execution.experiment_state")
    try:
        raise error
    except OSError:
        with caplog.at_level(logging.ERROR, logger=logger.name):
            logger.error("Saving experiment state to storage failed with exception: ", exc_info=True)
    assert [r.levelname for r in caplog.records if r.name == logger.name] == (["ERROR"] if shown else [])


def four_yields(batch: dict) -> object:
    """A task that hands on its rows in four batches, each a little over the streamed block size."""
    rows = STREAMED_BLOCK_BYTES // 1000 + 1
    for _ in range(4):
        yield {"pixels": np.zeros((rows, 1000), np.uint8), "path": np.full(rows, "x")}


@pytest.mark.parametrize(
    ("how", "blocks"),
    [("as Ray builds it", 1), ("streamed_blocks", 4), ("streamed_blocks, then select_columns", 1)],
)
def test_a_tasks_yields_leave_it_merged_into_large_blocks_and_a_fused_select_columns_holds_them_all(
    ray_runtime, how, blocks
):
    """Workaround: ``streamed_blocks`` (Ray Data merges a map task's yields into 128 MiB blocks before any
    leaves the task, and a ``select_columns`` fused after it makes one block of the task's whole output)."""
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray's workers cannot import tests/
    ds = ray.data.range(1, override_num_blocks=1).map_batches(four_yields, batch_size=None)
    if how != "as Ray builds it":
        ds = streamed_blocks(ds)
    if how.endswith("select_columns"):
        ds = ds.select_columns(["pixels"])
    assert ds.materialize().num_blocks() == blocks


def test_mlflows_system_metrics_monitor_logs_into_a_run_the_client_api_made(tmp_path):
    """MLflow 3.17's internal monitor (what :func:`system_metrics_monitor` starts) samples this node into a
    run created by id, under ``system/``. When MLflow moves or changes it, this fails first."""
    import time

    from mlflow import MlflowClient

    from pipeline.common.workarounds import system_metrics_monitor

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("e")).info.run_id
    monitor = system_metrics_monitor(run_id, 0.2, False, uri)
    time.sleep(1.5)
    monitor.finish()
    logged = client.get_run(run_id).data.metrics
    assert "system/cpu_utilization_percentage" in logged and "system/system_memory_usage_megabytes" in logged


def test_mlflows_sql_store_fails_two_runs_logging_one_new_dataset_at_once_and_the_workaround_links_both(tmp_path):
    """MLflow 3.17: eight runs logging the same new dataset at once, some fail on its unique key (the store looks it
    up, then inserts); :func:`log_inputs` links it to every run. When MLflow makes the insert safe, the first half
    fails: the workaround can go."""
    import json
    import threading

    from mlflow import MlflowClient
    from mlflow.entities import Dataset, DatasetInput

    from pipeline.common.workarounds import log_inputs

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.create_experiment("race")

    def race(log, name: str) -> tuple[list[str], list[str]]:
        runs, errors = [client.create_run(experiment).info.run_id for _ in range(8)], []
        dataset = DatasetInput(Dataset(name=name, digest="d", source_type="local", source=json.dumps({"uri": name})))
        barrier = threading.Barrier(len(runs))

        def one(run_id: str) -> None:
            barrier.wait()
            try:
                log(run_id, [dataset])
            except Exception as err:
                errors.append(str(err))

        threads = [threading.Thread(target=one, args=(run_id,)) for run_id in runs]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return runs, errors

    lost = []
    for attempt in range(20):  # the race is lost within a few rounds on two cores
        lost += race(lambda run_id, inputs: client.log_inputs(run_id, datasets=inputs), f"plain{attempt}")[1]
        if lost:
            break
    assert lost and all("UNIQUE constraint failed" in error for error in lost)
    for attempt in range(5):
        runs, errors = race(lambda run_id, inputs: log_inputs(client, run_id, inputs), f"worked{attempt}")
        assert errors == []
        assert all(
            [i.dataset.name for i in client.get_run(r).inputs.dataset_inputs] == [f"worked{attempt}"] for r in runs
        )


MANY_IDLE_ACTORS = """
import os, time
import ray
from pipeline.runtime.cluster import start_ray

cores = os.cpu_count()
start_ray(None, 2 * cores)  # a local runtime of twice as many logical CPUs as cores, as the pipeline starts one


@ray.remote(num_cpus=0)
class Idle:
    def pid(self):
        return os.getpid()


actors = [Idle.remote() for _ in range(4 * cores + 8)]
print(len(set(ray.get([actor.pid.remote() for actor in actors]))), "actors", flush=True)
time.sleep(3)  # the raylet's warning reaches the driver through the GCS
"""


@pytest.mark.slow  # starts Ray in a subprocess, twice
@pytest.mark.parametrize("concurrency", ["Ray's", "ours"])
def test_ray_warns_of_worker_processes_at_four_times_the_cores_unless_sized_to_the_logical_cpus(concurrency):
    """Workaround: ``local_runtime_settings`` sets ``RAY_worker_maximum_startup_concurrency`` to the local
    runtime's logical CPUs. Ray warns once 4 x min(cores, num_cpus) worker processes run beside its 8 I/O
    workers' allowance: 4 x cores + 8 actors on twice as many logical CPUs as cores pass that, and stay under
    the 8 x cores + 8 of the pipeline's setting."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k not in ("RAY_worker_maximum_startup_concurrency", "RAY_ADDRESS")}
    if concurrency == "Ray's":  # what Ray's raylet is told without the workaround: min(cores, num_cpus)
        env["RAY_worker_maximum_startup_concurrency"] = str(os.cpu_count())
    done = subprocess.run([sys.executable, "-c", MANY_IDLE_ACTORS], env=env, capture_output=True, text=True)
    assert f"{4 * os.cpu_count() + 8} actors" in done.stdout, done.stderr[-2000:]
    warned = "worker processes have been started" in done.stdout + done.stderr
    assert warned == (concurrency == "Ray's")


STARTED_IN_A_THREAD = """
import os, sys, threading, time
import psutil
import ray
from pipeline.common import workarounds
from pipeline.runtime.cluster import init_ray

if sys.argv[1] == "ended":  # a plain thread: it ends once Ray is up
    thread = threading.Thread(target=init_ray, args=(None, 2, None, None))
    thread.start()
    thread.join()
else:
    workarounds.in_a_lasting_thread(lambda: init_ray(None, 2, None, None)).result()
gcs = [p for p in psutil.Process().children(recursive=True) if "gcs_server" in p.name()]
time.sleep(2)
print("gcs alive:", all(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in gcs), len(gcs), flush=True)
os._exit(0)  # no ray.shutdown: an ended thread's GCS cannot answer it
"""


@pytest.mark.slow  # starts Ray in a subprocess, twice
@pytest.mark.parametrize("thread", ["ended", "lasting"])
def test_a_local_runtime_started_in_a_thread_dies_when_the_thread_ends_unless_it_lasts(thread):
    """Workaround: ``workarounds.in_a_lasting_thread``. Ray starts its GCS and raylet with PR_SET_PDEATHSIG, which
    Linux ties to the forking thread: a helper thread that started Ray and ended takes them with it (SIGKILL);
    one that stays keeps them."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run([sys.executable, "-c", STARTED_IN_A_THREAD, thread], env=env, capture_output=True, text=True)
    assert f"gcs alive: {thread == 'lasting'} 1" in done.stdout, done.stdout + done.stderr[-2000:]
