"""One training job, start to end, on the driver: checks -> datasets -> tracker -> fit -> model logged.

Every check that can fail on the user's input runs before the job's MLflow run is created (those
that need Ray, once it is up). A single run that fails them leaves nothing in MLflow; a sweep's job
records them as a FAILED child run, so the sweep shows every job it tried.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field

import ray
from ray.exceptions import RayError

from pipeline import cluster, console, preprocess, source, tracking, trainer
from pipeline.config import PipelineError, active_steps, check_targets, check_values
from pipeline.tracking import Tracker
from pipeline.worker import CHECKPOINT_FILE

log = logging.getLogger(__name__)


@dataclass
class Job:
    """Where a job sits: its output directory, experiment name and, in a sweep, the sweep's directory."""

    run_dir: str
    experiment: str
    overrides: list[str] = field(default_factory=list)
    sweep_dir: str | None = None  # set for the jobs of a Hydra multirun
    run_name: str | None = None
    # where startup_s counts from: pipeline.STARTED_AT for a command's first job, its own start for a sweep's later ones
    started_at: float = field(default_factory=time.time)

    @classmethod
    def in_sweep(cls, sweep_dir: str, number: int, experiment: str, overrides: list[str]) -> Job:
        """Job ``number`` of a Hydra multirun, in ``<sweep_dir>/<number>``, its run named for its overrides."""
        shown = " ".join(o for o in overrides if o != f"+experiment={experiment}")
        sweep_dir = os.path.abspath(sweep_dir)
        run_name = f"job {number}: {shown}".strip()
        return cls(os.path.join(sweep_dir, str(number)), experiment, overrides, sweep_dir, run_name)


def run(cfg: dict, job: Job) -> dict:
    """Run one experiment from its resolved config; returns the last epoch's metrics."""
    job.run_dir = os.path.abspath(job.run_dir)
    console.quiet_libraries()
    try:
        splits = preflight(cfg)
        plan = preprocess.cache_plan(cfg, splits)
    except PipelineError as err:
        if job.sweep_dir:  # a sweep keeps a record of every job it tried
            Tracker.open(cfg, job).end("FAILED", err)
        raise
    os.makedirs(job.run_dir, exist_ok=True)
    tracker, data = Tracker.open(cfg, job), None
    log.info("MLflow run %s in %s; outputs in %s", tracker.run_id, tracking.redact(tracker.uri), job.run_dir)
    try:
        with resume_hint(tracker), tracker:  # the run ends FINISHED, or FAILED / KILLED with the error
            data = datasets(cfg, splits, plan)
            tracker.log_data(splits, data.statistics)
            reporter = report_cache(data, tracker)
            tracker.expected_rows = expected_rows(cfg, data.rows)
            storage = trainer.run_storage(cfg["storage"], job.run_dir, tracker.run_id, tracker.resume_from)
            tracker.set_storage(storage.uri)
            steps, wait_limit = trainer.epoch_steps(cfg, data), cfg["tracking"]["data_wait_warning"]
            progress = console.Progress(cfg["train"]["epochs"], steps, wait_limit)
            result = trainer.fit(cfg, data, storage, trainer.Handler(tracker, job.run_dir, progress))
            reporter.join()  # training read every row, so the cache is built: its figures land before the run ends
            if tracker.last is None:
                raise PipelineError("training finished without reporting an epoch.")
            if cfg["tracking"]["log_model"] and result.checkpoint is not None:
                with result.checkpoint.as_directory() as path:
                    tracker.log_model(os.path.join(path, CHECKPOINT_FILE))
    finally:
        if data is not None:
            ray.kill(data.epoch_counter)
    metric = cfg["optimized_metric"]
    log.info(
        "finished: %s %.4f; browse with: mlflow ui --backend-store-uri %s",
        metric,
        tracker.last[metric],
        tracking.redact(tracker.uri),
    )
    return {k: tracker.last[k] for k in tracker.metrics}


def datasets(cfg: dict, splits: dict[str, source.Split], plan: preprocess.CachePlan) -> preprocess.TrainingData:
    """The job's datasets (with the cache on, its tasks are submitted here and run while training starts);
    a transform that fails on the data in a pass made now (``ingest.standardize``'s) fails the run here,
    in one line naming the cause."""
    try:
        return preprocess.training_data(cfg, splits, plan)
    except RayError as err:
        raise PipelineError(
            f"preprocessing failed: {trainer.root_cause(err)} (full tracebacks: Ray's session logs, "
            "/tmp/ray/session_latest/logs on the head node)."
        ) from err


def report_cache(data: preprocess.TrainingData, tracker: Tracker) -> threading.Thread:
    """Say what ``ingest.cache`` holds, on the console and in MLflow, once it is built: a helper thread
    waits while training reads the first pieces. A piece that failed to build fails training itself,
    which names the cause; this thread then says nothing."""

    def wait_and_report() -> None:
        try:
            data.plan.built = {name: cache.built() for name, cache in data.caches.items()}
        except RayError:
            return
        log.info("ingest: %s", data.plan.summary())
        tracker.log_cache(data.plan)

    thread = threading.Thread(target=wait_and_report, name="cache-report", daemon=True)
    thread.start()
    return thread


@contextmanager
def resume_hint(tracker: Tracker) -> Iterator[None]:
    """On Ctrl-C or SIGTERM, say how to continue the run."""
    try:
        yield
    except (KeyboardInterrupt, SystemExit):
        name = tracker.client.get_run(tracker.run_id).info.run_name
        log.warning(
            "interrupted: MLflow run %r ended KILLED; its checkpoints stay. Continue it with the same "
            "command plus: train.resume=true tracking.run_name=%s",
            name,
            name,
        )
        raise


def preflight(cfg: dict) -> dict[str, source.Split]:
    """Config, data and storage checks, then Ray started or joined and the checks that need it: the
    job fits a local runtime; every node of a cluster reaches the storage and data. The checked
    splits, or a PipelineError before anything is recorded.

    Ray's start mostly waits on the processes it launches, so a helper thread meanwhile imports and
    checks the ``_target_`` callables and opens the MLflow store (a new SQLite store creates its
    tables), work that would otherwise come one after the other."""
    check_values(cfg)
    splits = source.prepare(cfg["source"])
    storage = cfg["storage"]["path"]
    if storage is not None:
        trainer.check_storage(storage, cfg["storage"]["s3"])
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="preflight") as helper:
        checked = helper.submit(check_targets_then_open_store, cfg)
        cluster.connect(cfg["ray"], cfg["scaling"])
        checked.result()
    if cfg["ray"]["address"] is None:  # a cluster may autoscale; a local runtime never grows
        transform_steps = [s for split in cfg["transforms"].values() for s in active_steps(split).values()]
        transform_cpus = max((s["num_cpus"] for s in transform_steps), default=0)
        trainer.check_resources(ray.cluster_resources(), cfg["scaling"], transform_cpus)
    shared = {f"source.{name}": split.files[0] for name, split in splits.items() if split.local}
    cluster.check_shared(cfg["ray"]["address"], {**shared, "storage.path": storage})
    return splits


def check_targets_then_open_store(cfg: dict) -> None:
    """The ``_target_`` checks, then, if they pass, the MLflow store opened: later clients of the same
    store reuse it (MLflow caches a store per URI). It holds no run until one is started."""
    check_targets(cfg)
    tracking.connect(cfg["tracking"]["uri"], cfg["paths"]["outputs"])


def expected_rows(cfg: dict, rows: dict[str, int]) -> dict[str, int]:
    """Rows each epoch must deliver, by metric, beyond what sharding drops by design: Ray Train's equal
    split drops up to N-1 rows per split, and ``drop_last`` the partial training batches (then only
    validation is counted). Fewer means a transform skipped rows."""
    dropped = cfg["scaling"]["num_workers"] - 1
    expected = {"val_rows": rows["valid"] - dropped}
    if not cfg["ingest"]["drop_last"]:
        expected["train_rows"] = rows["train"] - dropped
    return expected
