"""A run's state on a team's tracking server (a real ``mlflow server`` on PostgreSQL, on 127.0.0.1): a driver that
beats is never ended whatever the clocks say, one silent for 15 minutes by the server's clock is; a resume while the
driver beats is refused and writes nothing; a stop stays stopped, also when ``ray job stop``'s SIGKILL cuts its wait
for the checkpoint short. Drivers run as processes of their own, with /proc unreadable to their liveness code (a
driver on another machine, or a Mac) and their wall clock skewed by 20 minutes."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from conftest import capture_warnings, compose_cfg, descendants, stand_in_command, stepped_clock
from mlflow import MlflowClient
from servers import mlflow_server, postgres, postgres_available

from pipeline.common.errors import PipelineError
from pipeline.jobs.job import Job
from pipeline.tracking import heartbeat, liveness, mlflow_store
from pipeline.tracking.tracker import Tracker

pytestmark = pytest.mark.skipif(postgres_available() is not None, reason=str(postgres_available()))
SKEW_S = 1200.0  # 20 minutes


@pytest.fixture(scope="module")
def tracking_server(tmp_path_factory):
    with postgres() as database, mlflow_server(database, str(tmp_path_factory.mktemp("artifacts"))) as url:
        yield url


def until(done, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


# A driver elsewhere: its run created and tagged as Tracker.open tags it, then beating every 0.1 s until killed.
ELSEWHERE = """
import sys, time
from mlflow import MlflowClient
from pipeline.tracking import heartbeat, liveness
liveness.PROC = "/nonexistent/proc"  # another machine's pids: not to be looked up from here
wall = time.time
time.time = lambda: wall() - float(sys.argv[4])  # its clock behind
heartbeat.BEAT_S = 0.1
client = MlflowClient(sys.argv[1])
tags = {liveness.DRIVER_TAG: liveness.this_driver()}
run_id = client.create_run(sys.argv[2], run_name=sys.argv[3], tags=tags).info.run_id
heartbeat.Heartbeat(client, sys.argv[1], run_id)
print(run_id, flush=True)
time.sleep(600)
"""


def snapshot(client: MlflowClient, run_id: str) -> tuple:
    """What a command could write to a run: its state, tags (less the beat), params and metrics."""
    run = client.get_run(run_id)
    tags = {k: v for k, v in run.data.tags.items() if k != liveness.HEARTBEAT_TAG}
    return run.info.status, run.info.end_time, tags, run.data.params, run.data.metrics


def test_a_beating_driver_is_never_ended_whatever_the_clocks_and_its_resume_is_refused_until_it_falls_silent(
    tracking_server, caplog, monkeypatch
):
    """A driver elsewhere, its clock 20 minutes behind, beats; this command's clock is stepped 20 minutes ahead: the
    run stays RUNNING, and a resume of it is refused in one paragraph naming the driver and its last beat, writing
    nothing. A run whose beat the server timed 17 minutes ago is ended KILLED, saying to stop its driver first if it
    still runs; one beaten by an older version's driver clock, which nothing here can time, is left as it is."""
    client = MlflowClient(tracking_server)
    experiment = client.create_experiment("clocks")
    driver = subprocess.Popen(
        [sys.executable, "-c", ELSEWHERE, tracking_server, experiment, "beating", str(SKEW_S)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        beating = driver.stdout.readline().strip()
        until(lambda: liveness.HEARTBEAT_TAG in client.get_run(beating).data.tags, "no first beat")
        now = liveness.server_time(tracking_server)
        assert abs(liveness.last_beat(client.get_run(beating).data.tags) - now) < 5  # the server's time, not its own
        silent_tags = {
            liveness.DRIVER_TAG: "other-host#b00t/1:4242:123",
            liveness.HEARTBEAT_TAG: liveness.beat_value(now - liveness.STALE_S - 120),
            mlflow_store.STORAGE_TAG: "s3://r/x",
        }
        silent = client.create_run(experiment, run_name="silent", tags=silent_tags).info.run_id
        old_tags = {liveness.DRIVER_TAG: "old-host#4026531836:77:1700000000.00", liveness.HEARTBEAT_TAG: "1700000000"}
        old = client.create_run(experiment, run_name="old", tags=old_tags).info.run_id

        stepped_clock(monkeypatch, SKEW_S)
        capture_warnings(caplog, monkeypatch, "pipeline.tracking.mlflow_store")
        assert mlflow_store.end_orphans(client) == [silent]
        assert [client.get_run(r).info.status for r in (beating, old)] == ["RUNNING", "RUNNING"]
        ended = client.get_run(silent)
        assert ended.info.status == "KILLED"
        why = "its driver (pid 4242 on other-host) has not beaten for 17 min (by the tracking server's clock)"
        assert f"driver gone: {why}" in ended.data.tags[mlflow_store.ERROR_TAG]
        assert "tracking.run_name=silent (if pid 4242 on other-host still runs, stop it first)" in caplog.text

        before = snapshot(client, beating)
        store = mlflow_store.Store(client, tracking_server, "clocks", experiment)
        with pytest.raises(PipelineError) as refused:
            mlflow_store.reopen_run(store, "beating")
        paragraph = str(refused.value)
        assert f"run 'beating' ({beating}) is still running: its driver (pid {driver.pid} on " in paragraph
        assert "(by the tracking server's clock). Stop pid" in paragraph and "in 15 min at the earliest" in paragraph
        assert snapshot(client, beating) == before  # nothing written
        beat = client.get_run(beating).data.tags[liveness.HEARTBEAT_TAG]
        until(lambda: client.get_run(beating).data.tags[liveness.HEARTBEAT_TAG] != beat, "the driver stopped beating")
    finally:
        driver.kill()
        driver.wait(timeout=30)


def test_a_stop_stays_stopped_and_a_driver_takes_back_only_a_run_ended_for_its_silence(
    tracking_server, tmp_path, monkeypatch
):
    """A driver's beat goes on through an error of any kind. A run another command ended for its silence is taken
    back at the next beat; once its own driver stops it (KILLED first, then the wait for the checkpoint), beats that
    would come in that wait leave it KILLED; a run another driver took since (a resume) is not taken back, and its
    old driver stops beating for it."""
    monkeypatch.setattr(heartbeat, "BEAT_S", 0.05)
    cfg = compose_cfg(["+experiment=smoke", f"tracking.uri={tracking_server}", "tracking.system_metrics_s=null"])
    store = mlflow_store.Store.open(cfg.tracking, str(tmp_path), "stops")
    held = {liveness.DRIVER_TAG: liveness.this_driver()}  # as Tracker.open tags a run
    tracker = Tracker.start(store, cfg, Job(str(tmp_path), "stops"), "stopped", None, held)
    client, run_id = store.client, tracker.run_id

    def beat() -> str:
        return client.get_run(run_id).data.tags.get(liveness.HEARTBEAT_TAG, "")

    set_tag, failed = client.set_tag, []

    def once_broken(*args):  # the first beat meets an error no MLflow call raises
        if not failed:
            failed.append(True)
            raise ValueError("a broken beat")
        set_tag(*args)

    monkeypatch.setattr(client, "set_tag", once_broken)
    with pytest.raises(SystemExit), tracker:
        until(lambda: failed and beat(), "the beat did not survive an error")
        mlflow_store.end_run(client, run_id, "KILLED", f"{liveness.ORPHAN}: taken for gone")
        until(lambda: client.get_run(run_id).info.status == "RUNNING", "the run was not taken back")
        assert mlflow_store.ERROR_TAG not in client.get_run(run_id).data.tags
        stop = SystemExit(143)
        tracker.stop_first(stop)  # what the job's stop does as it comes, before the wait for the checkpoint
        time.sleep(1.0)  # the wait: 20 beats' time
        assert client.get_run(run_id).info.status == "KILLED"
        raise stop
    assert client.get_run(run_id).info.status == "KILLED"

    taken = Tracker.start(store, cfg, Job(str(tmp_path), "stops"), "taken", None, held)
    with taken:
        until(lambda: liveness.HEARTBEAT_TAG in client.get_run(taken.run_id).data.tags, "no beat")
        client.set_tag(taken.run_id, liveness.DRIVER_TAG, "elsewhere#b00t/1:99:1")  # a resume elsewhere took it
        mlflow_store.end_run(client, taken.run_id, "KILLED", f"{liveness.ORPHAN}: taken for gone")
        time.sleep(0.5)
        last = client.get_run(taken.run_id).data.tags[liveness.HEARTBEAT_TAG]
        time.sleep(2.0)  # past the second's beats: the stamp would move on
        after = client.get_run(taken.run_id)
        assert after.info.status == "KILLED" and after.data.tags[liveness.HEARTBEAT_TAG] == last
    # its end is the other driver's to record: this one's, FINISHED here, is not written
    assert client.get_run(taken.run_id).info.status == "KILLED"


def test_a_run_sigkilled_in_its_stops_wait_for_the_checkpoint_stays_killed(tracking_server, tmp_path, data_root):
    """``ray job stop``'s sequence on the command's driver, beating every 0.2 s with its clock 20 minutes ahead:
    SIGTERM mid-step (a ViT step of seconds), the stop recorded KILLED, beats through the wait for the step's
    checkpoint, then SIGKILL inside that wait. The run is KILLED, never RUNNING again."""
    args = [
        "+experiment=smoke",
        "model.num_layers=12",  # the tutorial's ViT: steps of seconds, so the wait for the step's checkpoint is too
        "model.hidden_dim=384",
        "model.mlp_dim=768",
        "tracking.log_every_n_steps=1",
        "tracking.experiment_name=sigkilled",
        f"paths.outputs={tmp_path / 'outputs'}",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    env = {**os.environ, "PIPELINE_DATA_DIR": str(data_root), "MLFLOW_TRACKING_URI": tracking_server}
    command = subprocess.Popen(
        stand_in_command(args, skew_s=SKEW_S, beat_s=0.2),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    client, started = MlflowClient(tracking_server), psutil.Process(command.pid)
    try:

        def first_step() -> list:
            assert command.poll() is None, f"the command ended before its first step:\n{command.stdout.read()[-3000:]}"
            found = client.get_experiment_by_name("sigkilled")
            runs = client.search_runs([found.experiment_id]) if found else []
            return runs if runs and "train_loss_step" in runs[0].data.metrics else []

        until(first_step, "no step within 240 s", timeout_s=240)
        (run,) = first_step()
        assert command.poll() is None
        command.send_signal(signal.SIGTERM)  # mid-step: the workers checkpoint once it ends
        until(lambda: client.get_run(run.info.run_id).info.status == "KILLED", "the stop was not recorded")
        time.sleep(1.0)  # five beats into the wait
        assert command.poll() is None, "the command ended before the SIGKILL: no wait was cut short"
    finally:
        killed = [started, *descendants(command.pid)]  # SIGKILL, the command's own Ray runtime with it
        for process in killed:
            with contextlib.suppress(psutil.Error):
                process.kill()
        psutil.wait_procs(killed, timeout=30)
        output = command.communicate(timeout=60)[0]
    assert client.get_run(run.info.run_id).info.status == "KILLED", output[-3000:]
    assert "stopping: checkpoint at the step the workers are on" in output
