"""Failures with real processes and signals: Ray lost under a run, Ctrl-C swallowed where it landed, a stopped
command leaving Ray only once its run has ended (a killed training worker: test_preemption.py).
(SIGTERM on the command and resuming the interrupted run into the same MLflow run: the S3 run in
test_s3.py, which is interrupted and resumed.)"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
from conftest import DETERMINISTIC, alive, compose_cfg, descendants
from mlflow import MlflowClient
from test_pipeline import cli_env

from pipeline.api import compose
from pipeline.common.errors import PipelineError
from pipeline.common.metrics import epoch_metrics
from pipeline.jobs.job import Job
from pipeline.jobs.train import run


def assert_all_gone(started: list[psutil.Process]) -> None:
    """Every process the command started has exited (within 30 s of the command itself; Ray's agents, which
    linger a minute without workarounds.end_agents_at_exit, included)."""
    deadline = time.monotonic() + 30
    while alive(started) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert started and alive(started) == {}  # Ray's raylet, GCS and every worker went with the driver


def wait_for_epochs(run_dir: Path, count: int, timeout_s: float = 300.0) -> None:
    """Block until the job's metrics.jsonl holds ``count`` reported epochs."""
    path, deadline = run_dir / "metrics.jsonl", time.monotonic() + timeout_s
    while not (path.exists() and len(path.read_text().splitlines()) >= count):
        assert time.monotonic() < deadline, f"no {count} epoch(s) reported in {run_dir}"
        time.sleep(0.05)


def start_cli(args: list[str], cwd: Path, data_root: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "pipeline", *args],
        cwd=cwd,
        env=cli_env(data_root),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def stop_after_first_epoch(
    tmp_path: Path, data_root: Path, args: list[str], stop: Callable[[subprocess.Popen, list[psutil.Process]], None]
) -> tuple[str, list[psutil.Process]]:
    """Start the command, ``stop(command, its processes)`` once epoch 1 is reported (epoch 2 is under way),
    and return its output and the processes it had started; it must exit non-zero."""
    process = start_cli([*args, "hydra.run.dir=run"], tmp_path, data_root)
    try:
        wait_for_epochs(tmp_path / "run", 1)
    except BaseException:  # the command and its Ray must not outlive a failed test
        for child in [*descendants(process.pid), psutil.Process(process.pid)]:
            with contextlib.suppress(psutil.Error):
                child.kill()
        process.communicate()
        raise
    started = descendants(process.pid)
    stop(process, started)
    output, _ = process.communicate(timeout=120)
    assert process.returncode != 0, output
    return output, started


def the_run(tmp_path: Path):
    client = MlflowClient(f"sqlite:///{tmp_path / 'outputs' / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("smoke").experiment_id])
    assert len(runs) == 1, [r.info.run_name for r in runs]  # no duplicate runs
    return client, runs[0]


def assert_each_epoch_once(client: MlflowClient, run_id: str, epochs: int) -> None:
    task = compose().task
    for key in epoch_metrics(task.type, task.metrics):
        assert sorted(m.step for m in client.get_metric_history(run_id, key)) == list(range(epochs)), key


@pytest.mark.slow
def test_ray_lost_under_a_run_fails_it_in_one_paragraph_and_leaves_no_process(tmp_path, data_root):
    """The local runtime's GCS and raylet SIGKILLed during epoch 2 (an OOM killer's choice) under a worker group: the
    command exits 1 with one paragraph saying Ray was lost and how to continue, the run is FAILED (not left
    RUNNING) with its epochs, and every process the command started is gone. (In local mode the command is the
    worker, which Ray 2.60 ends itself, no Python run, the moment its object store's raylet is gone.)"""

    def kill_ray(command: subprocess.Popen, started: list[psutil.Process]) -> None:
        for process in started:
            with contextlib.suppress(psutil.Error):
                if process.name() in ("raylet", "gcs_server"):
                    process.kill()

    args = ["+experiment=smoke", *DETERMINISTIC, "scaling.local_mode=false", "tracking.run_name=lost"]
    output, started = stop_after_first_epoch(tmp_path, data_root, args, kill_ray)
    assert "Ray was lost under the run: " in output and "Traceback" not in output, output[-3000:]
    assert (
        "Once Ray is back, continue it with the same command plus: train.resume=true tracking.run_name=lost" in output
    )
    client, run_info = the_run(tmp_path)
    assert run_info.info.status == "FAILED" and "Ray was lost" in run_info.data.tags["pipeline.error"]
    assert len(client.get_metric_history(run_info.info.run_id, "train_loss")) >= 1
    assert_all_gone(started)


@pytest.mark.slow  # Ray starts before the store is asked for the run
def test_resume_without_a_run_to_resume_is_a_clear_error(tmp_path, data_root, monkeypatch):
    monkeypatch.setenv("PIPELINE_DATA_DIR", str(data_root))
    cfg = compose_cfg(
        [
            "+experiment=smoke",
            f"paths.outputs={tmp_path / 'outputs'}",
            "train.resume=true",
            "tracking.run_name=never-ran",
        ]
    )
    with pytest.raises(PipelineError, match=r"train.resume=true: no run named 'never-ran'"):
        run(cfg, Job(str(tmp_path / "run"), "smoke"))


def test_a_ctrl_c_swallowed_where_it_landed_still_stops_training(monkeypatch):
    """A KeyboardInterrupt raised inside a finalizer is only printed; the request it made still ends fit()."""
    from pipeline.common import signals
    from pipeline.training import trainer

    monkeypatch.setattr(signals, "_requests", [])

    class SlowTrainer:  # stands in for TorchTrainer: fit() would return after 10 s
        def fit(self) -> str:
            time.sleep(10)
            return "finished"

    def swallowed_ctrl_c() -> None:
        with contextlib.suppress(KeyboardInterrupt):  # what happens to it inside a __del__
            signals.request_stop(KeyboardInterrupt())

    threading.Timer(0.3, swallowed_ctrl_c).start()
    with pytest.raises(KeyboardInterrupt):  # not "finished"
        trainer.fit_off_main_thread(SlowTrainer())


def test_python_marks_a_running_thread_ended_when_a_signal_interrupts_its_join():
    """Canary (Python 3.11): why ``fit_off_main_thread`` waits on an Event. A join that a signal handler's exception
    interrupts releases the live thread's lock and marks it ended (threading.py's bpo-45274 branch): a later join
    returns at once, and the stopped command shut Ray down under a thread still in ray.get."""
    release = threading.Event()
    thread = threading.Thread(target=release.wait, daemon=True)
    thread.start()

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 0.2)
    try:
        with pytest.raises(KeyboardInterrupt):
            thread.join()
    finally:
        signal.signal(signal.SIGALRM, previous)
    thread.join(timeout=5)
    assert not thread.is_alive() and not release.is_set()  # "ended" at once, though it still waits
    release.set()


def test_a_stopped_fit_leaves_ray_only_once_its_run_has_ended(monkeypatch):
    """On a stop after which the workers end (their stop checkpoint saved), the exit handler shuts Ray down after
    Ray Train's run has returned, not while the fit thread is still in ray.get (a SIGSEGV at exit, Ray 2.60)."""
    from pipeline.common import signals
    from pipeline.training import trainer

    monkeypatch.setattr(signals, "_requests", [])
    at_exit, order = [], []
    monkeypatch.setattr(trainer.atexit, "register", at_exit.append)
    monkeypatch.setattr(trainer.ray, "shutdown", lambda: order.append("ray shut down"))

    class EndingTrainer:  # stands in for TorchTrainer: its run ends 1 s after the stop
        def fit(self) -> str:
            time.sleep(1.0)
            order.append("run ended")
            return "stopped"

    def sigterm() -> None:  # the handler's request, raised where the main thread waits on training
        with contextlib.suppress(SystemExit):
            signals.request_stop(SystemExit(143))

    threading.Timer(0.2, sigterm).start()
    with pytest.raises(SystemExit):
        trainer.fit_off_main_thread(EndingTrainer(), on_stop=lambda error, ended: True)
    assert order == []  # the process has not begun to exit
    (leave_ray,) = at_exit
    leave_ray()
    assert order == ["run ended", "ray shut down"]
