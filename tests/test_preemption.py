"""A preemption costs a step, not an epoch: runs stopped mid-epoch or while validating (SIGTERM: a notice), or with
a worker SIGKILLed or the whole process group shut down (no notice), continue from the step they reached, and a
ledger kept by the model itself (each training forward appends the row numbers it saw: tests/ledger_model.py) shows
every row trained on once per epoch, on the same or another number of workers. (``ray job stop`` with Ray's
defaults, mid-epoch: the S3 job in test_jobs.py.)
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import psutil
import pyarrow.fs as pafs
import pytest
import torch
from conftest import COMMANDS, LEDGER_ROWS
from mlflow import MlflowClient
from test_pipeline import cli_env

from pipeline.common.errors import PipelineError
from pipeline.config import TrainConfig, TransformSpec
from pipeline.data.pieces import row_numbers, trained
from pipeline.data.steps import Steps
from pipeline.training import checkpoint, preemption
from pipeline.training.ledger import Ledger
from pipeline.training.telemetry import EpochTelemetry
from transforms.randomness import ROW

TESTS = Path(__file__).resolve().parent
TRAIN_ROWS, BATCH = LEDGER_ROWS, 20


def command(tmp_path: Path, data: Path, *overrides: str, features: tuple[str, int] = ("[row,x0,x1]", 3)) -> list[str]:
    """The ledger model on ``data``, 2 epochs, each step slowed so that a stop lands mid-epoch."""
    return [
        sys.executable,
        "-m",
        "pipeline",
        f"source.train={data / 'train'}",
        f"source.valid={data / 'valid'}",
        f"source.feature_column={features[0]}",
        "source.label_column=target",
        "source.num_classes=2",
        "source.limit=null",
        "source.download=null",
        *([] if any(o.startswith("transforms=") for o in overrides) else ["transforms=none"]),
        "~model",
        "+model._target_=ledger_model.LedgerModel",
        f"+model.in_channels={features[1]}",
        "+model.num_classes=2",
        f"+model.log_dir={tmp_path / 'ledger'}",
        "+model.delay_s=0.03",
        f"ingest.batch_size={BATCH}",
        "train.epochs=2",
        "tracking.log_model=false",
        "tracking.log_every_n_steps=5",
        f"paths.outputs={tmp_path / 'outputs'}",
        "hydra.run.dir=run",
        *overrides,
    ]


def start(tmp_path: Path, data: Path, *overrides: str, own_group: bool = False, **options) -> subprocess.Popen:
    """The command, its output piped; ``own_group``: in a process group of its own, as a login session or a Slurm
    job step runs it, so that a test can signal it whole."""
    (tmp_path / "ledger").mkdir(exist_ok=True)
    env = {**cli_env(data), "PYTHONPATH": str(TESTS)}  # the workers import the ledger model
    process = subprocess.Popen(
        command(tmp_path, data, *overrides, **options),
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=own_group,
    )
    COMMANDS.append(process)
    return process


def finish(process: subprocess.Popen, returncode: int = 0) -> str:
    output, _ = process.communicate(timeout=300)
    assert process.returncode == returncode, output[-3000:]
    return output


def forwards(path: Path) -> int:
    return path.read_text().count("T ") if path.exists() else 0


def wait_for_step(tmp_path: Path, pid: int, steps: int, timeout_s: float = 180.0) -> None:
    """Until the worker process ``pid`` has trained on ``steps`` batches."""
    deadline = time.monotonic() + timeout_s
    while forwards(tmp_path / "ledger" / f"{pid}.log") < steps:
        assert time.monotonic() < deadline, f"worker {pid} never reached step {steps}"
        time.sleep(0.02)


def workers(tmp_path: Path, count: int = 1) -> list[dict]:
    """The run's workers.jsonl once it names ``count`` workers: every worker group's ranks and pids, in the order
    they started."""
    path, deadline = tmp_path / "run" / "workers.jsonl", time.monotonic() + 180
    while len(started := path.read_text().splitlines() if path.exists() else []) < count:
        assert time.monotonic() < deadline, f"fewer than {count} workers started"
        time.sleep(0.05)
    return [json.loads(line) for line in started]


def epochs_of(pid: int, tmp_path: Path, first: int = 0, steps: int | None = None) -> dict[int, list[int]]:
    """The rows worker ``pid`` trained on, by epoch (its ledger's validation marks end each one), from epoch
    ``first``; ``steps``: its first steps only (those the checkpoint its successors started from kept)."""
    epochs: list[list[list[int]]] = [[]]
    for line in (tmp_path / "ledger" / f"{pid}.log").read_text().splitlines():
        if line == "V":
            if epochs[-1]:
                epochs.append([])
            continue
        if steps is None or sum(map(len, epochs)) < steps:
            epochs[-1].append([int(row) for row in line[2:].split()])
    return {first + i: [row for step in steps for row in step] for i, steps in enumerate(epochs) if steps}


def assert_each_row_once(*ledgers: dict[int, list[int]], epochs: int = 2) -> None:
    for epoch in range(epochs):
        counts = Counter(row for ledger in ledgers for row in ledger.get(epoch, []))
        twice = sorted(row for row, n in counts.items() if n > 1)
        assert not twice, f"epoch {epoch}: rows trained on twice: {twice[:10]}"
        missed = sorted(set(range(TRAIN_ROWS)) - set(counts))
        assert not missed, f"epoch {epoch}: rows never trained on: {missed[:10]}"


def the_run(tmp_path: Path):
    client = MlflowClient(f"sqlite:///{tmp_path / 'outputs' / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("default").experiment_id])
    return client, run


def history(client: MlflowClient, run, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))


def final_weights(tmp_path: Path, key: str = "model") -> dict[str, torch.Tensor]:
    """The last checkpoint's trained weights (``model``) or averages (``ema``)."""
    reports = checkpoint.reports(pafs.LocalFileSystem(), str(next((tmp_path / "run" / "checkpoints").iterdir())))
    path, _ = reports[-1]
    return checkpoint.load(path, "the run's last checkpoint")[key]


def wait_for_validation(tmp_path: Path, pid: int, timeout_s: float = 180.0) -> None:
    """Until the worker process ``pid`` validates."""
    ledger, deadline = tmp_path / "ledger" / f"{pid}.log", time.monotonic() + timeout_s
    while not (ledger.exists() and "V" in ledger.read_text().split()):
        assert time.monotonic() < deadline, f"worker {pid} never validated"
        time.sleep(0.02)


@pytest.mark.slow  # runs the command, which starts Ray
# "raylet" left to the fault soak (tests/test_soak.py, -m soak, whose faults include it): the suite's time
@pytest.mark.parametrize("killed", ["driver", pytest.param("raylet", marks=pytest.mark.soak)])
def test_a_run_whose_driver_is_killed_mid_epoch_is_ended_killed_by_the_next_command(tmp_path, ledger_data, killed):
    """The driver SIGKILLed mid-epoch (the OOM killer's choice): nothing ran to end its run, RUNNING. The next command
    on the same store ends it KILLED as it starts, with the reason, and says how to continue it. Or its raylet: Ray
    2.60 ends the driver at once when it next reads the object store (a one-worker run trains in the driver's
    process), and the run is left RUNNING as well, unless the lifeline saw the raylet gone first and recorded it
    FAILED (a race: both happen); either way no run stays RUNNING past the next command."""
    common = ["scaling.num_workers=1", "train.epochs=1", "model.delay_s=0.1"]
    process = start(tmp_path, ledger_data, *common, "tracking.run_name=orphan")
    assert workers(tmp_path)[0]["pid"] == process.pid  # Ray Train's local mode: the command is the worker
    wait_for_step(tmp_path, process.pid, TRAIN_ROWS // BATCH // 2)
    if killed == "driver":
        process.kill()
    else:
        (raylet,) = [p for p in psutil.Process(process.pid).children(recursive=True) if p.name() == "raylet"]
        raylet.kill()
    assert process.wait(timeout=60) != 0
    output = process.communicate(timeout=60)[0]
    client = MlflowClient(f"sqlite:///{tmp_path / 'outputs' / 'mlflow.db'}")
    (orphan,) = client.search_runs([client.get_experiment_by_name("default").experiment_id])
    if orphan.info.status == "FAILED":  # the raylet's: the lifeline saw it gone before a read of the store ended us
        assert killed == "raylet" and "Ray was lost under the run: this machine's raylet" in output, output[-2000:]
    else:
        assert orphan.info.status == "RUNNING"

    output = finish(start(tmp_path, ledger_data, *common, "tracking.run_name=next"))
    ended = client.get_run(orphan.info.run_id)
    if orphan.info.status == "RUNNING":
        said = f"MLflow run 'orphan' ({orphan.info.run_id}) was left RUNNING: its driver (pid {process.pid} on "
        assert said in output and "Ended KILLED. Continue it with: python -m pipeline " in output
        assert output.index(said) < output.index("start-up:")  # as the command starts, before training
        assert ended.info.status == "KILLED" and f"pid {process.pid}" in ended.data.tags["pipeline.error"]
    else:
        assert ended.info.status == "FAILED" and "was left RUNNING" not in output
    (following,) = client.search_runs([ended.info.experiment_id], filter_string="attributes.run_name = 'next'")
    assert following.info.status == "FINISHED"


@pytest.mark.slow  # runs the command, which starts Ray
def test_a_run_stopped_twice_resumes_at_its_steps_each_row_once_and_ends_where_an_uninterrupted_one_does(
    tmp_path, ledger_data
):
    """One worker (in the command's process: Ray Train's local mode), rows in block order: two uninterrupted runs
    compute the same weights. SIGTERM while epoch 1
    validates (slowly): validation stops and the checkpoint holds all of epoch 1's steps. Resumed, the run trains
    no row of epoch 1 again and validates it; SIGTERM halfway through epoch 2: the worker checkpoints at the step it
    is on. Resumed again, it continues after that step. Each time the run ends KILLED; in the end each row was
    trained on once per epoch, each epoch is logged once with the whole epoch's figures, the step losses go on from
    the step reached, and the weights and their averages (train.ema, validated as val_*) are the uninterrupted run's."""
    deterministic = ["scaling.num_workers=1", "ingest.preserve_order=true", "train.ema=0.9"]
    straight = tmp_path / "straight"
    straight.mkdir()
    finish(start(straight, ledger_data, *deterministic))
    straight_client, uninterrupted = the_run(straight)
    per_epoch = TRAIN_ROWS // BATCH

    # a SIGTERM with no SIGKILL behind it (a spot notice's minutes, not ray job stop's 3 s): its checkpoint waited for
    # validation's 5 batches take 5 s, so that the notice lands in them on a loaded machine (0.3 s a batch missed once
    # in the full suite: the driver's notice came after validation's 1.5 s); a training step 0.1 s, so that the second
    # notice, sent halfway through epoch 2, lands in it (0.03 s, the rest of it 0.75 s, missed once in CI)
    stopped = ["+model.valid_delay_s=1.0", "model.delay_s=0.1", "tracking.run_name=stopped", "train.stop_grace_s=60"]
    stopped += deterministic
    first = start(tmp_path, ledger_data, *stopped)
    assert workers(tmp_path)[0]["pid"] == first.pid  # one worker: Ray Train's local mode, in the command's process
    wait_for_validation(tmp_path, first.pid)
    first.send_signal(signal.SIGTERM)
    assert f"stopping: checkpointed at epoch 1, step {per_epoch}" in finish(first, 143)
    storage = str(next((tmp_path / "run" / "checkpoints").iterdir()))
    (taken,) = [report for _, report in checkpoint.reports(pafs.LocalFileSystem(), storage) if "epoch_step" in report]
    assert taken["why"] == preemption.STOPPING  # asked for in validation, after the training steps' last check

    second = start(tmp_path, ledger_data, *stopped, "train.resume=true")
    wait_for_step(tmp_path, workers(tmp_path, 2)[1]["pid"], per_epoch // 2)
    second.send_signal(signal.SIGTERM)
    output = finish(second, 143)
    assert f"continuing at epoch 1/2 after its step {per_epoch} on 1 worker" in output
    assert "stopping: checkpointed at epoch 2" in output, output
    client, run = the_run(tmp_path)
    assert run.info.status == "KILLED"
    (_, validated), (saved, _) = history(client, run, "checkpoint_step")  # the two stops' checkpoints
    assert validated == per_epoch < saved < 2 * per_epoch

    resumed = finish(start(tmp_path, ledger_data, *stopped, "train.resume=true"))
    client, run = the_run(tmp_path)
    assert run.info.status == "FINISHED"
    assert f"continuing at epoch 2/2 after its step {saved - per_epoch} on 1 worker" in resumed
    assert history(client, run, "restored_at_step") == [(1, per_epoch), (2, saved)]
    first_pid, second_pid, last_pid = [w["pid"] for w in workers(tmp_path)]
    assert_each_row_once(
        epochs_of(first_pid, tmp_path), epochs_of(second_pid, tmp_path, first=1), epochs_of(last_pid, tmp_path, first=1)
    )
    steps = [step for step, _ in history(client, run, "train_loss_step")]
    assert steps == list(range(5, 2 * per_epoch + 1, 5))  # each logged once, going on from the step reached
    for key in ("train_loss", "val_loss", "raw_val_loss", "train_rows"):  # each epoch once, the whole epoch's figures
        ours, theirs = history(client, run, key), history(straight_client, uninterrupted, key)
        assert [s for s, _ in ours] == [0, 1], key
        assert np.allclose([v for _, v in ours], [v for _, v in theirs], atol=1e-6), key
    assert history(client, run, "val_loss") != history(client, run, "raw_val_loss")  # the averages scored, not the raw
    for key in ("model", "ema"):
        expected, got = final_weights(straight, key), final_weights(tmp_path, key)
        assert all(torch.allclose(expected[name], got[name], atol=1e-6) for name in expected), key
    trained, averaged = final_weights(tmp_path)["linear.weight"], final_weights(tmp_path, "ema")["linear.weight"]
    assert not torch.allclose(trained, averaged)


@pytest.mark.slow  # runs the command, which starts Ray
def test_a_streamed_run_restarts_after_a_kill_and_resumes_after_a_shutdown_each_row_and_step_once(
    tmp_path, ledger_data
):
    """The training split streamed (not cached), shuffled, on 2 workers, 3 epochs, train.checkpoint_every=10 steps.
    Rank 1 SIGKILLed mid-epoch 1 (no notice): the worker group restarts from the latest step checkpoint, at most 10
    steps back (train.max_failures=1). In epoch 2, a machine's shutdown as Ray's processes see it: SIGTERM to the
    command's whole process group (the driver, Ray's head processes), SIGKILL 3 s later; no checkpoint on the notice
    comes, Ray's raylet being gone. The run is not left RUNNING. Resumed on 1 worker (the global batch kept), it
    loses at most 10 of the steps trained before the SIGTERM (the workers, outside the group, train on until they
    see the raylet gone: those are trained again too; docs/troubleshooting.md). Dropping the steps each group took
    past the checkpoint its successor started from, each row of every epoch was trained on once; each epoch is
    logged once, and every logged step loss: those on their way to the driver when it died come from the
    checkpoints' reports. Ray kept the best epoch's checkpoint and the latest (num_to_keep=1 by val_accuracy): no
    step checkpoint."""
    every, per_epoch = 10, TRAIN_ROWS // BATCH  # a worker's steps: half of each global batch, half the rows
    run = [
        "ingest.cache=false",
        "train.epochs=3",  # the third for the steps the workers train after the SIGTERM
        "model.delay_s=0.1",
        f"train.checkpoint_every={every}",
        "train.max_failures=1",
        "train.num_to_keep=1",
        "train.checkpoint_metric=val_accuracy",
        "tracking.run_name=moved",
    ]
    process = start(tmp_path, ledger_data, *run, "scaling.num_workers=2", own_group=True)
    first_group = workers(tmp_path, 2)
    rank1 = next(w["pid"] for w in first_group if w["rank"] == 1)
    wait_for_step(tmp_path, rank1, per_epoch // 2 + 3)
    killed_at = forwards(tmp_path / "ledger" / f"{rank1}.log")
    psutil.Process(rank1).kill()
    restarted_group = workers(tmp_path, 4)[2:]
    rank0 = next(w["pid"] for w in restarted_group if w["rank"] == 0)
    wait_for_step(tmp_path, rank0, per_epoch // 3 + per_epoch // 2)  # in epoch 2 by then
    os.killpg(process.pid, signal.SIGTERM)
    noticed = forwards(tmp_path / "ledger" / f"{rank0}.log")  # the steps it trained before the shutdown began
    time.sleep(3)  # ray job stop's wait (Slurm's KillWait is 30 s: docs/troubleshooting.md says what more costs)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.communicate(timeout=120)
    deadline = time.monotonic() + 60  # a Ray worker is not in the group: it ends once it sees the raylet gone
    while any(psutil.pid_exists(w["pid"]) for w in restarted_group):
        assert time.monotonic() < deadline, "a worker outlived Ray by a minute"
        time.sleep(0.1)
    client, stopped = the_run(tmp_path)
    assert stopped.info.status == "KILLED"
    trained = forwards(tmp_path / "ledger" / f"{rank0}.log")

    resumed = finish(start(tmp_path, ledger_data, *run, "scaling.num_workers=1", "train.resume=true"))
    assert "continuing at epoch" in resumed and "on 1 worker" in resumed
    client, run = the_run(tmp_path)
    assert run.info.status == "FINISHED" and [s for s, _ in history(client, run, "val_loss")] == [0, 1, 2]
    (_, restarted), (_, restored) = history(client, run, "restored_at_step")
    restarted, restored = int(restarted), int(restored)
    assert killed_at - every <= restarted <= killed_at, (killed_at, restarted)
    assert restarted + noticed - every <= restored <= restarted + trained, (restarted, noticed, restored, trained)
    last = workers(tmp_path, 5)[-1]["pid"]
    assert_each_row_once(
        *(epochs_of(w["pid"], tmp_path, steps=restarted) for w in first_group),
        *(epochs_of(w["pid"], tmp_path, steps=restored - restarted) for w in restarted_group),
        epochs_of(last, tmp_path, first=restored // per_epoch),
        epochs=3,
    )
    logged = {step for step, _ in history(client, run, "train_loss_step")}
    assert logged == set(range(5, 3 * per_epoch + 1, 5))  # none missing
    storage = next((tmp_path / "run" / "checkpoints").iterdir())
    kept = json.loads((storage / "checkpoint_manager_snapshot.json").read_text())["checkpoint_results"]
    reports = [json.loads((storage / c["checkpoint_dir_name"] / "report.json").read_text()) for c in kept]
    assert all("epoch_step" not in report for report in reports) and {r["epoch"] for r in reports} <= {0, 1, 2}


def test_the_ledger_counts_rows_over_workers_and_packs_those_trained_on_as_bits():
    """Rows are numbered by row group in file order; the bits a checkpoint keeps are the rows counted, and a
    resumed epoch's ledger starts with them, counted once (on rank 0)."""
    groups = [type("Group", (), {"rows": n})() for n in (3, 5, 2)]
    assert row_numbers(groups).tolist() == [0, 3, 8, 10]
    ledger = Ledger(10, torch.device("cpu"), rank=0)
    ledger.add({ROW: torch.tensor([7, 2, 9])})
    ledger.add({"x": torch.zeros(2)})  # a batch without row numbers (validation's) counts nothing
    bits = ledger.trained()
    assert trained(bits, np.arange(10)).tolist() == [i in (2, 7, 9) for i in range(10)]
    assert Ledger(10, torch.device("cpu"), rank=0, start=bits).gathered().tolist() == [
        int(i in (2, 7, 9)) for i in range(10)
    ]
    assert Ledger(10, torch.device("cpu"), rank=1, start=bits).gathered().sum() == 0


def test_row_numbers_pass_steps_that_return_only_their_columns_and_a_step_that_drops_them_with_rows_fails():
    keep = ["features", "label"]
    own = TransformSpec(fn={"_target_": "test_preemption.only_features"})
    batch = {"features": np.arange(4.0), "label": np.arange(4), "other": np.zeros(4), ROW: np.array([5, 1, 8, 2])}
    assert Steps({"own": own}, [], keep)(dict(batch))[ROW].tolist() == [5, 1, 8, 2]
    dropping = TransformSpec(fn={"_target_": "test_preemption.first_two_rows"})
    with pytest.raises(
        PipelineError, match=f"step 'drop' changed the number of rows .4 given. and dropped the column '{ROW}'"
    ):
        Steps({"drop": dropping}, [], keep)(dict(batch))


def only_features(batch: dict) -> dict:
    return {"features": batch["features"] * 2, "label": batch["label"]}


def first_two_rows(batch: dict) -> dict:
    return {"features": batch["features"][:2], "label": batch["label"][:2]}


def test_a_checkpoint_within_an_epoch_stands_after_the_epoch_before_and_before_its_own_end(tmp_path):
    """The newest whole checkpoint, by place: epoch 1's step 30 after epoch 0's end and epoch 1's step 20."""
    for name, report in [
        ("a", {"epoch": 0}),
        ("b", {"epoch": 1, "epoch_step": 30}),
        ("c", {"epoch": 1, "epoch_step": 20}),
    ]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "checkpoint.pt").write_bytes(b"x")
        checkpoint.write_report(str(tmp_path / name), report, {"checkpoint.pt": 1})
    assert [Path(path).name for path, _ in checkpoint.reports(pafs.LocalFileSystem(), str(tmp_path))] == ["a", "c", "b"]
    assert Path(checkpoint.newest(pafs.LocalFileSystem(), str(tmp_path))).name == "b"
    assert checkpoint.place({"epoch": 1}) > checkpoint.place({"epoch": 1, "epoch_step": 10**9})


def test_an_epoch_resumed_from_a_checkpoint_within_it_reports_the_whole_epochs_figures():
    """Six batches in one pass, and three, a checkpoint's carried sums, then three more: the same epoch figures."""
    batches = [(torch.tensor(0.5 + i), torch.tensor([i % 3, (i + 1) % 3])) for i in range(6)]

    def run(telemetry: EpochTelemetry, part) -> EpochTelemetry:
        for step, (loss, labels) in part:
            telemetry.batch(step, loss, len(labels))
            telemetry.batch_labels(labels)
        return telemetry

    whole = run(EpochTelemetry(torch.device("cpu"), classes=3), enumerate(batches, 1)).totals()
    first = run(EpochTelemetry(torch.device("cpu"), classes=3), enumerate(batches[:3], 1))
    resumed = EpochTelemetry(torch.device("cpu"), classes=3)
    resumed.resume(first.carried(), rank=0)
    rest = run(resumed, enumerate(batches[3:], 4)).totals()
    for key in ("train_loss", "train_rows", "label_mix"):
        assert rest[key] == pytest.approx(whole[key]), key


@pytest.mark.slow
def test_the_driver_waits_for_the_workers_checkpoint_at_most_its_grace_and_takes_one_that_comes(ray_runtime):
    """The notice's protocol on a real actor: the workers told first, then the stop recorded; a stop with no
    checkpoint answering ends after the grace, with None (not an error, which would end a stopped run FAILED); a
    worker that hears the stop and saves is heard at once; training that ends meanwhile ends the wait."""
    import ray

    from pipeline.training.events import StepCheckpointed

    silent, told = preemption.Notice.remote(), []
    started = time.monotonic()

    # the stop is recorded (meanwhile) once the workers' wait has ended with it: they save while the driver records
    def recorded() -> None:
        told.append(ray.get(silent.stopped.remote(), timeout=5))

    assert preemption.checkpoint_before_stop(silent, grace_s=0.5, meanwhile=recorded) is None
    assert 0.5 <= time.monotonic() - started < 10 and told == [True]

    notice, saved = preemption.Notice.remote(), StepCheckpointed(epoch=1, step=7, global_step=39, checkpoint="c")

    def answering() -> None:  # a worker, as a thread: it waits on the stop, then answers
        ray.get(notice.stopped.remote())
        notice.checkpointed.remote(saved)

    thread = threading.Thread(target=answering, daemon=True)
    thread.start()
    started = time.monotonic()
    assert preemption.checkpoint_before_stop(notice, grace_s=30) == saved
    assert time.monotonic() - started < 10  # heard at once, not at the end of the grace

    # training ends while the driver waits (its last epoch done, its workers gone): none will answer
    quiet, ended = preemption.Notice.remote(), threading.Event()
    threading.Timer(0.5, ended.set).start()
    started = time.monotonic()
    assert preemption.checkpoint_before_stop(quiet, grace_s=30, ended=ended) is None
    assert time.monotonic() - started < 10  # not the grace's 30 s
    for actor in (silent, notice, quiet):
        ray.kill(actor)

    # the notice gone is a notice too: it lives with the driver, so the driver's process or node is going
    gone = preemption.Notice.remote()
    due = preemption.Due(TrainConfig(checkpoint_every=None), gone, drains=False)
    assert not due.stopping.wait(0.5)
    ray.kill(gone)
    assert due.stopping.wait(30) and due.notice is None  # stopping, and no answer awaited from it
