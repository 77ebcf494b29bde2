"""Runs on the driver: the TorchTrainer, ``fit()``, and what workers send back while it runs.

The workers run :func:`pipeline.worker.train_loop_per_worker`. While ``fit()`` runs, a driver thread
takes their events off a Ray queue and hands them on: progress to the console, each epoch's report
(all ranks' metrics, checked to agree) to the tracker and ``metrics.jsonl``, restores to both.

The last section holds every workaround for Ray's own behaviour, each with the Ray version and the
behaviour it targets; ``tests/test_ray_canaries.py`` fails when Ray changes that behaviour.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any

import pyarrow.fs as pafs
import ray
import ray.data
import ray.train
from ray.exceptions import RayError
from ray.train import CheckpointConfig, DataConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer
from ray.util.placement_group import PlacementGroup, remove_placement_group
from ray.util.queue import Empty, Queue

from pipeline import console
from pipeline.config import PipelineError, lower_is_better
from pipeline.filesystems import is_s3, locate, s3_error
from pipeline.preprocess import TrainingData
from pipeline.tracking import Tracker
from pipeline.worker import train_loop_per_worker

log = logging.getLogger(__name__)
# How long the driver's thread waits on the queue per call. Each call is a message to the queue actor,
# so a short wait costs CPU all run long; the end of a run wakes the thread at once with a "stop" event.
QUEUE_WAIT_S = 5.0


@dataclass
class RunStorage:
    """Where Ray Train keeps a run's checkpoints: ``path``/``name`` on ``filesystem``, shown as ``uri``."""

    path: str
    name: str
    filesystem: pafs.FileSystem
    uri: str


def run_storage(storage: dict, run_dir: str, run_id: str, resume_from: str | None = None) -> RunStorage:
    """Each run's checkpoints live under its MLflow run id, in ``storage.path`` (a shared path or
    ``s3://`` URI) or else the job's output directory (``<run_dir>/checkpoints``). Ray Train restores
    from whatever it finds there, so a fresh run, with a fresh id, never resumes by accident; a
    resumed run passes the place its first attempt recorded (``resume_from``)."""
    if resume_from is not None:
        parent, name = resume_from.rsplit("/", 1)
    else:
        parent, name = (storage["path"] or os.path.join(run_dir, "checkpoints")).rstrip("/"), run_id
    fs, path = locate(parent, storage["s3"], "storage.path")
    return RunStorage(path, name, fs, f"{parent if is_s3(parent) else path}/{name}")


def check_storage(uri: str, s3: dict) -> None:
    """Create the storage directory now, so a missing bucket or a read-only store fails before training."""
    fs, path = locate(uri, s3, "storage.path")
    try:
        fs.create_dir(path, recursive=True)
    except OSError as err:
        if is_s3(uri):
            raise s3_error("storage.path", uri, err) from err
        raise PipelineError(f"storage.path: cannot create {uri} ({err}).") from err


def check_resources(available: dict[str, float], scaling: dict, transform_cpus: float) -> None:
    """Fail fast where Ray would wait forever: training workers that do not fit the runtime, or
    workers that take every CPU so preprocessing never gets one (Ray Data then stalls silently)."""
    per_worker = scaling["resources_per_worker"]
    for resource, amount in per_worker.items():
        needed, have = amount * scaling["num_workers"], available.get(resource, 0.0)
        if needed > have:
            hint = " Use scaling=cpu on a machine without GPUs." if resource == "GPU" else ""
            raise PipelineError(
                f"scaling asks for {needed:g} {resource} ({scaling['num_workers']} workers x {amount:g}, "
                f"scaling.resources_per_worker.{resource}) but the Ray runtime has {have:g}.{hint}"
            )
    cpus = available.get("CPU", 0.0)
    spare = cpus - per_worker.get("CPU", 0.0) * scaling["num_workers"]
    if spare < transform_cpus:
        raise PipelineError(
            f"training workers take {cpus - spare:g} of {cpus:g} CPUs, leaving {spare:g} for preprocessing, "
            f"which needs {transform_cpus:g} (transforms.*.num_cpus): lower scaling.resources_per_worker.CPU "
            "or scaling.num_workers, or raise ray.num_cpus."
        )


def steps_per_epoch(train_rows: int, num_workers: int, global_batch: int, drop_last: bool) -> int:
    """Batches each worker sees per epoch: Ray Train splits a dataset into equal shards."""
    rows, batch = train_rows // num_workers, global_batch // num_workers
    return rows // batch if drop_last else -(-rows // batch)


def trainer_settings(scaling: dict) -> tuple[ScalingConfig, TorchConfig]:
    """Ray's scaling and process-group settings: nccl on GPU workers, gloo on CPU workers; workers go
    only to nodes with their resources (custom ones included) and ``label_selector`` labels."""
    scaling_config = ScalingConfig(
        num_workers=scaling["num_workers"],
        use_gpu=scaling["use_gpu"],
        resources_per_worker=dict(scaling["resources_per_worker"]),
        label_selector=dict(scaling["label_selector"]) or None,
    )
    return scaling_config, TorchConfig(backend="nccl" if scaling["use_gpu"] else "gloo")


def data_config(cfg: dict) -> DataConfig:
    """How Ray Train executes the datasets it splits: Ray's defaults, unless the config changes them."""
    data_cpus = cfg["scaling"]["data_cpus"]
    execution_options = None
    if data_cpus is not None or cfg["ingest"]["preserve_order"]:
        execution_options = ray.data.ExecutionOptions(preserve_order=cfg["ingest"]["preserve_order"])
        if data_cpus is not None:
            execution_options.resource_limits = ray.data.ExecutionResources(cpu=data_cpus)
    return DataConfig(execution_options=execution_options)


def build_trainer(cfg: dict, data: TrainingData, storage: RunStorage, events: Queue, callbacks: list) -> TorchTrainer:
    """A TorchTrainer for the resolved config; workers send their events to ``events``; ``callbacks``
    run in Ray Train's controller besides the one that relays each report to ``events``."""
    scaling_config, torch_config = trainer_settings(cfg["scaling"])
    return TorchTrainer(
        train_loop_per_worker,
        train_loop_config={
            "cfg": cfg,
            "events": events,
            "epoch_counter": data.epoch_counter,
            "statistics": data.statistics,
            "steps_per_epoch": epoch_steps(cfg, data),
        },
        scaling_config=scaling_config,
        torch_config=torch_config,
        datasets=data.datasets,
        dataset_config=data_config(cfg),
        run_config=RunConfig(
            name=storage.name,
            storage_path=storage.path,
            storage_filesystem=storage.filesystem,
            checkpoint_config=CheckpointConfig(
                num_to_keep=cfg["train"]["num_to_keep"],
                checkpoint_score_attribute=cfg["train"]["checkpoint_metric"],
                checkpoint_score_order=checkpoint_mode(cfg["train"]),
            ),
            failure_config=FailureConfig(max_failures=cfg["train"]["max_failures"]),
            callbacks=[ReportRelay(events), *callbacks],
        ),
    )


def checkpoint_mode(train: dict) -> str:
    """``train.checkpoint_mode``, or, when null, min for a loss or an error metric and max otherwise."""
    if train["checkpoint_mode"] is not None:
        return train["checkpoint_mode"]
    metric = train["checkpoint_metric"]
    return "min" if metric is not None and lower_is_better(metric) else "max"


def epoch_steps(cfg: dict, data: TrainingData) -> int:
    """Batches each worker sees per epoch of this job."""
    scaling, ingest = cfg["scaling"], cfg["ingest"]
    return steps_per_epoch(data.rows["train"], scaling["num_workers"], ingest["batch_size"], ingest["drop_last"])


def fit(cfg: dict, data: TrainingData, storage: RunStorage, handler, callbacks: tuple = ()) -> ray.train.Result:
    """Train to the end, handing every worker event to ``handler`` (:class:`Handler` for a job; a Tune
    trial's own, see ``trial.py``); a worker or controller failure becomes one PipelineError naming
    its cause. ``callbacks``: more Ray Train callbacks (a Tune trial's TuneReportCallback)."""
    events = Queue(actor_options={"num_cpus": 0})
    try:
        trainer = build_trainer(cfg, data, storage, events, list(callbacks))
        with relayed(events, handler):
            try:
                return fit_off_main_thread(trainer)
            except ray.train.TrainingFailedError as err:
                raise explain(err) from err
    finally:
        ray.kill(events.actor)


class ReportRelay(ray.train.UserCallback):
    """Runs in Ray Train's controller: every report (all ranks' metrics, the persisted checkpoint) to the driver."""

    def __init__(self, events: Queue):
        self.events = events

    def after_report(self, run_context, metrics: list[dict], checkpoint) -> None:
        self.events.put(("report", {"ranks": metrics, "checkpoint": checkpoint.path if checkpoint else None}))


class Handler:
    """What the driver does with each worker event."""

    def __init__(self, tracker: Tracker, run_dir: str, progress: console.Progress):
        self.tracker, self.run_dir, self.progress = tracker, run_dir, progress

    def progress_event(self, event: dict) -> None:
        self.tracker.log_startup(event["at"], event["epoch"])
        if event["log"]:
            self.tracker.log_step_loss(event["loss"], event["global_step"])
        self.progress.update(event)

    def worker_event(self, event: dict) -> None:
        self.append("workers.jsonl", event)

    def report_event(self, event: dict) -> None:
        ranks = checked_ranks(event)
        self.append("metrics.jsonl", {"checkpoint": event["checkpoint"], "ranks": ranks})
        self.tracker.log_epoch(ranks[0])
        self.progress.epoch_done(ranks[0])

    def restored_event(self, event: dict) -> None:
        self.tracker.log_restore(event["epoch"])
        self.progress.restored(event["epoch"])

    def append(self, name: str, record: dict) -> None:
        with open(os.path.join(self.run_dir, name), "a") as out:
            out.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self.progress.close()


def checked_ranks(report: dict) -> list[dict]:
    """A report's per-rank metrics in rank order, checked to agree."""
    ranks = sorted(report["ranks"], key=lambda r: r["rank"])
    check_ranks_agree(ranks)
    return ranks


def check_ranks_agree(ranks: list[dict]) -> None:
    """DDP replicas must hold identical weights and, after the all-reduce, identical metrics."""
    for key in ("weights_sha256", "val_loss", *filter(console.is_task_metric, ranks[0])):
        values = {r[key] for r in ranks}
        if len(values) > 1:
            raise PipelineError(f"training workers disagree on {key} after epoch {ranks[0]['epoch']}: {values}.")


@contextmanager
def relayed(events: Queue, handler: Handler):
    """A driver thread hands every event to ``handler`` while the body runs; then the queue is
    drained and whatever a handler raised is raised here."""
    stop, errors = threading.Event(), []

    def relay() -> None:
        while True:
            try:
                kind, payload = events.get(timeout=QUEUE_WAIT_S)
            except Empty:
                if stop.is_set():
                    break
                continue
            if kind == "stop":
                break
            try:
                getattr(handler, f"{kind}_event")(payload)
            except BaseException as err:  # raised on the main thread once fit() returns
                errors.append(err)
        handler.close()

    thread = threading.Thread(target=relay, name="event-relay", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        with suppress(RayError):  # a lost queue actor: the thread sees `stop` within QUEUE_WAIT_S instead
            events.put(("stop", None))
        thread.join()
    if errors:
        raise errors[0]


# --- Workarounds for Ray's behaviour (ray 2.60.0); tests/test_ray_canaries.py pins each one. ---------


def local_runtime_settings() -> None:
    """Environment for a local runtime, set before ``ray.init`` so every Ray process inherits it.

    Ray 2.60: Ray Train's controller starts a preemption watcher (another process, several seconds
    on 2 cores) unless ``RAY_TRAIN_ENABLE_PREEMPTION_WATCHER=0``; nothing preempts a local runtime.
    """
    os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")


_stop_requests: list[BaseException] = []


def request_stop(error: BaseException) -> None:
    """A signal handler's body: raise ``error`` (KeyboardInterrupt, SystemExit) now, and again from
    :func:`fit_off_main_thread`'s wait loop. An exception a handler raises while a finalizer runs on
    the main thread (Ray's handles have ``__del__``) is only printed; a lost Ctrl-C would leave
    training running."""
    _stop_requests.append(error)
    raise error


def fit_off_main_thread(trainer: TorchTrainer) -> ray.train.Result:
    """``trainer.fit()`` in a helper thread, waited on from this one.

    Ray 2.60: ``TorchTrainer.fit()`` on the main thread installs its own SIGINT handler and leaves it
    installed; it turns Ctrl-C into exit status 0 and keeps the run's controller actor (and its
    dataset split coordinators) alive after the run, so a sweep piles them up. Off the main thread it
    installs none: Ctrl-C and SIGTERM reach the pipeline as KeyboardInterrupt / SystemExit, the run
    is recorded as KILLED, and leaving the process takes the run's actors with it.
    """
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["result"] = trainer.fit()
        except BaseException as err:  # re-raised on the calling thread
            outcome["error"] = err

    thread = threading.Thread(target=target, name="ray-train-fit", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(timeout=0.5)  # a bounded wait lets signals through
        if _stop_requests:
            raise _stop_requests[0]
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


def root_cause(err: BaseException) -> str:
    """The innermost error of a worker failure, as ``Type: message``.

    Ray 2.60 flattens an error raised in a task or actor (a Ray Data transform, a training worker)
    into traceback text; the last ``SomeError: ...`` line that is not one of Ray's wrappers is what
    user code raised.
    """
    lines = [
        line
        for line in str(err).splitlines()
        if re.match(r"^[A-Za-z_][\w.]*(Error|Exception)\b.*: ", line) and not line.startswith("ray.")
    ]
    return lines[-1] if lines else f"{type(err).__name__}: {err}"


def explain(err: ray.train.TrainingFailedError) -> PipelineError:
    """One line per distinct cause, instead of Ray's truncated multi-rank traceback snippet."""
    if isinstance(err, ray.train.WorkerGroupError):
        causes = sorted({root_cause(e) for e in err.worker_failures.values()})
        where = f"on rank(s) {sorted(err.worker_failures)}"
    else:  # ControllerError: the controller itself failed (storage, a callback, scheduling)
        causes, where = [root_cause(getattr(err, "controller_failure", err))], "in Ray Train's controller"
    return PipelineError(
        f"training failed {where}: {'; '.join(causes)} "
        "(full tracebacks: Ray's session logs, /tmp/ray/session_latest/logs on the head node)."
    )


def release_placement_group(group_id: str) -> None:
    """Remove a Tune trial's training placement group (hex id, as :func:`pipeline.worker.where_this_runs`
    reports it) once the trial has ended, if it is still there.

    Ray 2.60: a Tune scheduler that stops a trial (ASHA, median stopping) ends the trial's actor, and
    with it the Ray Train controller the trial started, before the controller removes its worker
    group's placement group. Ray Train's PlacementGroupCleaner would remove it, but it asks the state
    API, which needs the dashboard; without one (a local runtime) the group holds its CPUs until the
    sweep's process exits, and later trials wait for them forever.
    """
    group = PlacementGroup(ray.PlacementGroupID(bytes.fromhex(group_id)))
    if ray.util.placement_group_table(group).get("state") not in (None, "REMOVED"):
        remove_placement_group(group)
