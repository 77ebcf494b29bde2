"""The tracking stage against a real MLflow store: what it writes, and what it must never write."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from conftest import capture_warnings, compose_cfg, stepped_clock
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException, RestException

from pipeline.jobs.job import Job
from pipeline.tracking import mlflow_store, spool
from pipeline.tracking.delivery import metrics_record
from pipeline.tracking.run_config import logged_config
from pipeline.tracking.tracker import Tracker


def write_checkpoint(state: dict, directory, metrics: dict) -> None:
    """A checkpoint as a worker writes it: rank 0's state, then the report naming every file and its size."""
    from pipeline.training import checkpoint

    checkpoint.write_state(state, str(directory))
    checkpoint.write_report(str(directory), metrics, checkpoint.files(str(directory)))


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
    store = mlflow_store.Store(client, client.tracking_uri, "e", experiment)
    job = Job(str(tmp_path), "e", overrides=["tracking.uri=https://alice:tok-3141@mlflow.example.com"])
    run_id = Tracker.start(store, cfg, job, None, None).run_id
    run = client.get_run(run_id)
    assert run.data.params["tracking.uri"] == "https://alice:***@mlflow.example.com"
    assert run.data.params["ray.runtime_env.env_vars.AWS_SECRET_ACCESS_KEY"] == "***"
    assert run.data.tags[mlflow_store.OVERRIDES_TAG] == "tracking.uri=https://alice:***@mlflow.example.com"
    logged = logged_config(client, run_id)
    assert logged.tracking.uri == "https://alice:***@mlflow.example.com"
    assert logged.ray.runtime_env["env_vars"] == {"AWS_SECRET_ACCESS_KEY": "***"}
    assert logged.model == cfg.model  # what the predict stage rebuilds the model from
    stored = (tmp_path / "mlflow.db").read_bytes() + (tmp_path / "artifacts").joinpath(
        run_id, "artifacts", "config.yaml"
    ).read_bytes()
    assert b"tok-3141" not in stored and b"sec-2718" not in stored


def test_resume_reopens_an_unfinished_run_and_refuses_a_finished_one(tmp_path):
    """A driver that died (SIGKILL, a lost machine) leaves its run RUNNING; Ctrl-C leaves it KILLED."""
    from pipeline.common.errors import PipelineError

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.create_experiment("e", artifact_location=(tmp_path / "artifacts").as_uri())
    store = mlflow_store.Store(client, client.tracking_uri, "e", experiment)
    for status in ("RUNNING", "KILLED", "FAILED"):
        tags = {mlflow_store.STORAGE_TAG: f"/ckpt/{status}"}
        run_id = client.create_run(experiment, run_name=f"r-{status}", tags=tags).info.run_id
        if status != "RUNNING":
            mlflow_store.end_run(client, run_id, status, "RuntimeError: stopped")
        assert mlflow_store.reopen_run(store, f"r-{status}") == (run_id, f"/ckpt/{status}")
        reopened = client.get_run(run_id)
        assert reopened.info.status == "RUNNING" and mlflow_store.ERROR_TAG not in reopened.data.tags
    done = client.create_run(experiment, run_name="done", tags={mlflow_store.STORAGE_TAG: "/ckpt/done"}).info.run_id
    mlflow_store.end_run(client, done, "FINISHED")
    with pytest.raises(PipelineError, match="run 'done' .* already finished"):
        mlflow_store.reopen_run(store, "done")


def test_runs_are_found_by_names_and_paths_that_hold_quotes(tmp_path):
    """MLflow's filter strings have no escape character: names with ', " or both still match exactly."""
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.create_experiment('it\'s a "test"', artifact_location=(tmp_path / "artifacts").as_uri())
    names = ["plain", "it's", 'say "hi"', "both ' and \"", 'both _ and "']  # the last is a LIKE look-alike
    ids = {name: client.create_run(experiment, run_name=name).info.run_id for name in names}
    for name in names:
        assert [r.info.run_id for r in mlflow_store.runs_where(client, experiment, "run_name", name)] == [ids[name]]
    mlflow_store.end_run(client, ids["both ' and \""], "KILLED")
    client.set_tag(ids["both ' and \""], mlflow_store.STORAGE_TAG, "/ckpt/q")
    store = mlflow_store.Store(client, client.tracking_uri, "e", experiment)
    assert mlflow_store.reopen_run(store, "both ' and \"") == (ids["both ' and \""], "/ckpt/q")
    sweep_dir = str(tmp_path / 'it\'s "here"')
    parent = mlflow_store.sweep_parent(client, experiment, sweep_dir)
    assert mlflow_store.sweep_parent(client, experiment, sweep_dir) == parent  # found again, not created twice


def run_with_storage(tmp_path: Path):
    """A smoke run started on a SQLite store in ``tmp_path``, its storage set: the config, client, store, tracker
    and storage."""
    from pipeline.runtime import filesystems

    cfg = compose_cfg(["+experiment=smoke", "tracking.log_model=false"])
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.create_experiment("e", artifact_location=(tmp_path / "artifacts").as_uri())
    store = mlflow_store.Store(client, client.tracking_uri, "e", experiment)
    tracker = Tracker.start(store, cfg, Job(str(tmp_path), "e"), None, None)
    storage = filesystems.run_storage(cfg.storage, str(tmp_path), tracker.run_id)
    tracker.set_storage(storage)
    return cfg, client, store, tracker, storage


def test_an_epoch_and_steps_never_reported_are_logged_from_the_workers_records_once_their_checkpoints_are_gone(
    tmp_path,
):
    """The driver gone before reports reached it, and Ray Train deleting the checkpoints they came with
    (train.num_to_keep=1): the run's end logs those epochs and step losses from the workers' records; training
    restored from an older checkpoint runs the epoch and its steps again, and their first records stand (each epoch
    and each step once)."""
    import torch

    from pipeline.training import records

    cfg, client, store, tracker, storage = run_with_storage(tmp_path)
    figures = {"train_loss": 2.0, "val_loss": 2.1, "val_accuracy": 0.2, "train_throughput": 9.0, "train_rows": 64}
    figures |= {"val_rows": 32, "data_wait_fraction": 0.1, "skipped_steps": 0, "workers": 2}
    for epoch in (0, 1, 2):  # all recorded; only epoch 0's report reached the driver; epoch 2's loss is NaN
        nan = {"val_loss": float("nan")} if epoch == 2 else {}
        metrics = {**figures, "epoch": epoch, "val_accuracy": 0.2 + epoch, **nan}
        steps = [(10 * epoch + 5, 1.0 + epoch, 1e9 + epoch), (10 * epoch + 10, 0.5 + epoch, 1e9 + epoch)]
        records.write(storage, {"epoch": epoch, "epoch_step": 5, "global_step": 10 * epoch + 5}, steps[:1])
        records.write(storage, metrics, steps[1:])
    saved = tmp_path / "checkpoints" / tracker.run_id / "checkpoint_2026-11-26_00-00-02"  # Ray kept the last only
    saved.mkdir(parents=True)
    write_checkpoint({"epoch": 2}, saved, {**figures, "epoch": 2, "val_loss": float("nan")})
    tracker.epochs.log_epoch({**figures, "epoch": 0})
    tracker.epochs.log_step_loss(1.0, 5, 1e9)
    with pytest.raises(SystemExit), tracker:  # ends the run: KILLED here, as on SIGTERM
        raise SystemExit(143)
    assert [(m.step, m.value) for m in client.get_metric_history(tracker.run_id, "val_accuracy")] == [
        (0, 0.2),
        (1, 1.2),
    ]
    losses = client.get_metric_history(tracker.run_id, "train_loss_step")
    expected = [(5, 1.0), (10, 0.5), (15, 2.0), (20, 1.5), (25, 3.0), (30, 2.5)]
    assert sorted((m.step, m.value) for m in losses) == expected
    assert client.get_run(tracker.run_id).info.status == "KILLED"

    resumed = Tracker(store, tracker.run_id, storage.uri, cfg)
    resumed.set_storage(storage)
    assert resumed.epochs.reconcile(storage) == []  # nothing new: every recorded epoch is logged
    assert resumed.epochs.last["val_accuracy"] == 1.2  # the newest finite one: a resume with no epoch left ends on it
    resumed.epochs.log_restore(1, 0)  # Ray Train restored epoch 0's checkpoint: epoch 1 runs again
    resumed.epochs.log_step_loss(9.0, 15, 2e9)  # step 15 trained again: its first record stands, as an epoch's
    resumed.epochs.log_epoch({**figures, "epoch": 1, "val_accuracy": 0.9})
    resumed.epochs.log_epoch({**figures, "epoch": 2, "val_accuracy": 0.95})
    history = client.get_metric_history(tracker.run_id, "val_accuracy")
    assert sorted((m.step, m.value) for m in history) == [(0, 0.2), (1, 1.2), (2, 0.95)]
    assert sorted((m.step, m.value) for m in client.get_metric_history(tracker.run_id, "train_loss_step")) == expected
    assert resumed.epochs.last["val_accuracy"] == 0.95 and torch.load(saved / "checkpoint.pt", weights_only=True) == {
        "epoch": 2
    }


def test_the_records_of_training_a_restore_abandons_are_dropped_and_the_epochs_run_again_are_logged(tmp_path):
    """Ray Train skipped the reports of epochs 2-4 (a worker group it was about to restart for a resize): their
    records were written, their checkpoints never. The restore from epoch 1's checkpoint drops the records placed
    after it, so MLflow gets epochs 0-1 from the records and 2-4 as they run again, not the abandoned ones."""
    from pipeline.training import records

    _, client, _, tracker, storage = run_with_storage(tmp_path)
    figures = {"train_loss": 2.0, "val_loss": 2.1, "train_throughput": 9.0, "train_rows": 64, "val_rows": 32}
    figures |= {"data_wait_fraction": 0.1, "skipped_steps": 0}
    for epoch in range(5):  # on two workers; a step checkpoint in epoch 1 and one in epoch 3 (abandoned)
        if epoch in (1, 3):
            records.write(storage, {"epoch": epoch, "epoch_step": 2, "global_step": 10 * epoch + 2}, [])
        records.write(storage, {**figures, "epoch": epoch, "workers": 2, "val_accuracy": 0.1 * epoch}, [])
    restored = {**figures, "epoch": 1, "workers": 2}
    records.drop_after(storage, restored)  # what the restoring worker does before it tells the driver
    assert [metrics["epoch"] for _, metrics in tracker.epochs.reconcile(storage)] == [0, 1]
    with tracker:
        tracker.epochs.log_restore(2, 20)
        for epoch in (2, 3, 4):  # run again on one worker
            tracker.epochs.log_epoch({**figures, "epoch": epoch, "workers": 1, "val_accuracy": 0.5 + epoch})
    history = sorted((m.step, m.value) for m in client.get_metric_history(tracker.run_id, "workers"))
    assert history == [(0, 2), (1, 2), (2, 1), (3, 1), (4, 1)]
    assert [(r["epoch"], "epoch_step" in r) for r in records.read(storage)] == [(0, False), (1, True), (1, False)]


def test_a_resumed_run_continues_from_the_newest_whole_checkpoint_in_its_storage(tmp_path):
    """What the workers fall back on when Ray Train restores an older checkpoint or none (it records one
    only after its copy to storage): the newest checkpoint whose file is whole; one whose copy was cut
    short, or that has no report beside it, is passed over."""
    import pyarrow.fs as pafs

    from pipeline.training import checkpoint

    fs = pafs.LocalFileSystem()
    for epoch in range(4):
        (tmp_path / f"checkpoint_{epoch}").mkdir()
        if epoch == 3:  # a sharded one: each rank's shards beside rank 0's checkpoint.pt
            (tmp_path / "checkpoint_3" / "model").mkdir()
            for rank in (0, 1):
                (tmp_path / "checkpoint_3" / "model" / f"__{rank}_0.distcp").write_bytes(b"x" * 1000)
        write_checkpoint({"epoch": epoch}, tmp_path / f"checkpoint_{epoch}", {"epoch": epoch})
    assert checkpoint.newest(fs, str(tmp_path)) == str(tmp_path / "checkpoint_3")
    shard = tmp_path / "checkpoint_3" / "model" / "__1_0.distcp"  # a rank's upload cut short
    shard.write_bytes(shard.read_bytes()[:-100])
    assert checkpoint.newest(fs, str(tmp_path)) == str(tmp_path / "checkpoint_2")
    cut = tmp_path / "checkpoint_2" / "checkpoint.pt"
    cut.write_bytes(cut.read_bytes()[:-100])
    assert checkpoint.newest(fs, str(tmp_path)) == str(tmp_path / "checkpoint_1")
    (tmp_path / "checkpoint_1" / "report.json").unlink()
    assert checkpoint.newest(fs, str(tmp_path)) == str(tmp_path / "checkpoint_0")
    assert checkpoint.newest(fs, str(tmp_path / "no-run")) is None


def test_a_spool_retries_what_an_away_server_did_not_take_and_stops_at_what_a_store_refused(tmp_path):
    """Over HTTP, a record the server did not answer for is tried again, in order, until it is taken; a record
    the store refused (a 4xx, or any error of a local store) stops delivery and is raised by flush."""
    refused = RestException({"error_code": "INVALID_PARAMETER_VALUE", "message": "bad key"})
    assert not spool.server_away(refused) and spool.server_away(MlflowException("API request failed: refused"))
    assert spool.server_away(RestException({"error_code": "TEMPORARILY_UNAVAILABLE", "message": "503"}))

    delivered, answers = [], [MlflowException("refused"), MlflowException("refused"), None, None]

    def flaky(record: dict) -> None:
        answer = answers.pop(0)
        if answer is not None:
            raise answer
        delivered.append(record["n"])

    away = spool.Spool(str(tmp_path / "away.jsonl"), {"run_id": "r"}, flaky, remote=True)
    away.add({"n": 1})
    away.add({"n": 2})
    assert away.flush(30) and delivered == [1, 2]  # the first one tried three times, the second after it
    header, records, sent = spool.read(str(tmp_path / "away.jsonl"))
    assert header == {"run_id": "r"} and records == [{"n": 1}, {"n": 2}] and sent == 2

    def refuse(record: dict) -> None:
        raise refused

    stopped = spool.Spool(str(tmp_path / "refused.jsonl"), {}, refuse, remote=True)
    stopped.add({"n": 1})
    with pytest.raises(RestException, match="bad key"):
        stopped.flush(30)
    local = spool.Spool(str(tmp_path / "local.jsonl"), {}, flaky, remote=False)  # a local store is never "away"
    answers.append(MlflowException("database is locked"))
    local.add({"n": 3})
    with pytest.raises(MlflowException, match="database is locked"):
        local.flush(30)
    assert spool.read(str(tmp_path / "local.jsonl"))[2] == 0


@pytest.mark.parametrize("failing", [True, False])
def test_a_record_the_store_refuses_ends_the_run_and_a_failing_runs_own_error_stays_the_one_raised(
    tmp_path, caplog, monkeypatch, failing
):
    """Delivery stops at a record the store refuses, so the end record is never sent: the run is ended
    directly, FAILED with the refusal when it had finished; a run that was already failing ends with its own
    error, which is raised, the refusal logged beside it."""
    capture_warnings(caplog, monkeypatch, "pipeline.tracking.record")
    cfg = compose_cfg(["+experiment=smoke", "tracking.log_model=false"])
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.create_experiment("e", artifact_location=(tmp_path / "artifacts").as_uri())
    tracker = Tracker.start(
        mlflow_store.Store(client, client.tracking_uri, "e", experiment), cfg, Job(str(tmp_path), "e"), None, None
    )
    tracker.record.spool_to(str(tmp_path))
    tracker.record.write(metrics_record({"no such metric?!": 1.0}, 0))  # MLflow refuses the name
    expected = RuntimeError("the run's own error") if failing else MlflowException
    with pytest.raises(type(expected) if failing else MlflowException) as raised, tracker:
        if failing:
            raise expected
    run = client.get_run(tracker.run_id)
    assert run.info.status == "FAILED"
    if failing:
        assert raised.value is expected and run.data.tags[mlflow_store.ERROR_TAG].endswith("the run's own error")
        assert "the MLflow store refused a record of run" in caplog.text
    else:
        assert "no such metric" in run.data.tags[mlflow_store.ERROR_TAG]


def test_a_stop_is_in_mlflow_before_the_spools_backlog(tmp_path):
    """SIGTERM (``ray job stop``, which SIGKILLs 3 s later by default) ends the run KILLED straight away,
    ahead of records the spool has not sent yet: a slow server cannot leave the run RUNNING."""
    cfg = compose_cfg(["+experiment=smoke", "tracking.log_model=false", "tracking.server_wait_s=1"])
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.create_experiment("e", artifact_location=(tmp_path / "artifacts").as_uri())
    store = mlflow_store.Store(client, client.tracking_uri, "e", experiment)
    tracker = Tracker.start(store, cfg, Job(str(tmp_path), "e"), None, None)
    deliver, release = tracker.record.delivery, threading.Event()
    tracker.record.delivery = lambda record: (release.wait(), deliver(record))  # a server that does not answer yet
    tracker.record.spool_to(str(tmp_path))
    for epoch in range(3):
        figures = {"train_loss": 1.0 / (epoch + 1), "val_loss": 1.0, "val_accuracy": 0.5}
        tracker.record.write(metrics_record(figures, epoch))
    with pytest.raises(SystemExit), tracker:
        raise SystemExit(143)
    run = client.get_run(tracker.run_id)
    assert run.info.status == "KILLED" and run.data.metrics == {}  # the end first; none of the backlog yet
    release.set()  # the server answers: the backlog follows, into the ended run
    assert tracker.record.spool.flush(30)
    assert [m.step for m in client.get_metric_history(tracker.run_id, "train_loss")] == [0, 1, 2]
    assert client.get_run(tracker.run_id).info.status == "KILLED"


def a_driver(uri: str, experiment: str, name: str) -> tuple[subprocess.Popen, str]:
    """A process that creates a run as a driver does (tagged with itself), then waits: killed, it ends nothing."""
    code = (
        "import sys, time; from mlflow import MlflowClient; from pipeline.tracking import liveness as l; "
        "c = MlflowClient(sys.argv[1]); "
        "print(c.create_run(sys.argv[2], run_name=sys.argv[3], tags={l.DRIVER_TAG: l.this_driver(), "
        "'pipeline.storage': '/ckpt', 'pipeline.overrides': '+experiment=smoke'}).info.run_id, flush=True); "
        "time.sleep(600)"
    )
    process = subprocess.Popen([sys.executable, "-c", code, uri, experiment, name], stdout=subprocess.PIPE, text=True)
    return process, process.stdout.readline().strip()


@pytest.mark.parametrize("proc", ["readable", "unreadable"])
def test_a_run_whose_driver_was_killed_is_ended_by_the_next_command_and_a_live_ones_is_not(
    tmp_path, caplog, monkeypatch, proc
):
    """A driver SIGKILLed leaves its run RUNNING; the next command on the store (any experiment) ends it KILLED,
    says why and how to continue it, whatever the clock does (stepped 20 minutes here). A live driver's run, another
    machine's (another boot of a host of the same name), one whose pid now names another process, and one no driver
    holds: the first, second and last stay RUNNING, and the live one cannot be resumed. Where /proc cannot be read
    (standing in for macOS and Windows), nothing is ended, that is said once, and a resume of the killed run is
    refused with how to end it: nothing is written."""
    from pipeline.common.errors import PipelineError
    from pipeline.tracking import liveness

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    first, second = (client.create_experiment(n, artifact_location=(tmp_path / n).as_uri()) for n in ("a", "b"))
    killed, killed_id = a_driver(uri, first, "killed")
    live, live_id = a_driver(uri, second, "live")
    try:
        killed.kill()
        killed.wait(timeout=30)
        where, pid, started = liveness.this_driver().rsplit(":", 2)
        host, machine = where.split("#")
        boot, namespace = machine.split("/")
        others = {
            # the same pid and name, another boot (or host): not ours to judge
            "elsewhere": f"{host}#{boot[::-1]}/{namespace}:{killed.pid}:{started}",
            "reused": f"{where}:{pid}:{int(started) - 100}",  # this pid, but a process started before it
            "untagged": None,
        }
        ids = {
            name: client.create_run(first, run_name=name, tags={liveness.DRIVER_TAG: tag} if tag else {}).info.run_id
            for name, tag in others.items()
        }
        assert client.get_run(killed_id).info.status == "RUNNING"
        stepped_clock(monkeypatch, 1200)
        if proc == "unreadable":
            monkeypatch.setattr(liveness, "PROC", str(tmp_path / "no-proc"))
            monkeypatch.setattr(liveness, "_said", False)
            assert liveness.this_driver() == f"{host}#?:{os.getpid()}:?"  # the tag a driver writes there

        capture_warnings(caplog, monkeypatch, "pipeline.tracking")  # whatever tests before left of logging
        caplog.set_level(logging.INFO, logger="pipeline.tracking.liveness")
        ended = mlflow_store.end_orphans(client)
        statuses = {name: client.get_run(run_id).info.status for name, run_id in {**ids, "live": live_id}.items()}
        store = mlflow_store.Store(client, uri, "a", first)

        if proc == "unreadable":
            said = caplog.text.count("whose driver this command cannot judge are left as they are")
            assert ended == [] and mlflow_store.end_orphans(client) == []
            assert set(statuses.values()) == {"RUNNING"} and client.get_run(killed_id).info.status == "RUNNING"
            assert said > 0 and caplog.text.count("cannot judge are left") == said, caplog.text  # said once
            assert "this machine cannot read its process table (no /proc: macOS, Windows)" in caplog.text
            before = client.get_run(killed_id)
            with pytest.raises(PipelineError) as refused:
                mlflow_store.reopen_run(store, "killed")
            paragraph = str(refused.value)
            assert f"cannot tell whether its driver lives: its driver (pid {killed.pid} on {host})" in paragraph
            assert f"MlflowClient('{uri}').set_terminated('{killed_id}', 'KILLED')" in paragraph
            after = client.get_run(killed_id)
            assert (after.info.status, after.data.tags, after.data.metrics) == (
                before.info.status,
                before.data.tags,
                before.data.metrics,
            )
            client.set_terminated(killed_id, "KILLED")  # as the paragraph says: then the resume goes on
            assert mlflow_store.reopen_run(store, "killed") == (killed_id, "/ckpt")
            return

        assert sorted(ended) == sorted([killed_id, ids["reused"]])
        gone = client.get_run(killed_id)
        assert gone.info.status == "KILLED"
        assert f"driver gone: its driver (pid {killed.pid} on {host}) ended" in gone.data.tags[mlflow_store.ERROR_TAG]
        assert (
            f"MLflow run 'killed' ({killed_id}) was left RUNNING" in caplog.text
            and "Continue it with: python -m pipeline +experiment=smoke train.resume=true tracking.run_name=killed"
            in caplog.text
        )
        assert live.poll() is None
        assert {name: statuses[name] for name in ("live", "elsewhere", "untagged")} == dict.fromkeys(
            ("live", "elsewhere", "untagged"), "RUNNING"
        )
        assert mlflow_store.end_orphans(client) == []  # once
        with pytest.raises(
            PipelineError, match=rf"run 'live' \({live_id}\) is still running: its driver, pid {live.pid} on {host}"
        ):
            mlflow_store.reopen_run(mlflow_store.Store(client, uri, "b", second), "live")  # two drivers, one run
    finally:
        for process in (killed, live):
            process.kill()
            process.wait(timeout=30)
