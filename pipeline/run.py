"""One job, start to end: config -> source -> transforms -> train -> tracking.

Every check that can fail on the user's input runs before the job's MLflow run is created (those
that need Ray, once it is up). A single run that fails them leaves nothing in MLflow; a sweep's job
records them as a FAILED child run, so the sweep shows every job it tried.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import ray
from ray.util.queue import Queue

from pipeline import cluster, console, preprocess, source, tracking, train
from pipeline.config import EPOCH_METRICS, PipelineError, active_steps, check_targets, check_values

log = logging.getLogger(__name__)
CODE_DIR = os.path.dirname(os.path.abspath(__file__))


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


def check_ranks_agree(ranks: list[dict]) -> None:
    """DDP replicas must hold identical weights and, after the all-reduce, identical metrics."""
    for key in ("weights_sha256", "val_loss", "val_accuracy"):
        values = {r[key] for r in ranks}
        if len(values) > 1:
            raise PipelineError(f"training workers disagree on {key} after epoch {ranks[0]['epoch']}: {values}.")


def root_cause(err: BaseException) -> str:
    """The innermost error of a worker failure, as ``Type: message``.

    Ray flattens errors raised in tasks and actors into traceback text, so the last
    ``SomeError: ...`` line that is not one of Ray's wrappers is what user code raised.
    """
    lines = [
        line
        for line in str(err).splitlines()
        if re.match(r"^[A-Za-z_][\w.]*(Error|Exception)\b.*: ", line) and not line.startswith("ray.")
    ]
    return lines[-1] if lines else f"{type(err).__name__}: {err}"


def explain(err: ray.train.WorkerGroupError) -> PipelineError:
    """One line per distinct cause, instead of Ray's truncated multi-rank snippet."""
    causes = sorted({root_cause(e) for e in err.worker_failures.values()})
    return PipelineError(
        f"training failed on rank(s) {sorted(err.worker_failures)}: {'; '.join(causes)} "
        "(full tracebacks: Ray's session logs, /tmp/ray/session_latest/logs on the head node)."
    )


def missing_rows(metrics: dict, splits: dict, num_workers: int, drop_last: bool) -> int:
    """Rows of the splits that never reached the training loop this epoch (a transform skipped them),
    beyond what sharding drops by design: Ray Train's equal split drops up to N-1 rows per split, and
    ``drop_last`` the partial training batches (then only validation is counted). A lower bound."""
    counted = [("valid", "val_rows")] + ([] if drop_last else [("train", "train_rows")])
    return sum(max(0, splits[name].rows - int(metrics[key]) - (num_workers - 1)) for name, key in counted)


def preflight(cfg: dict) -> dict[str, source.Split]:
    """Config, data and storage checks, then Ray started or joined and the checks that need it: the
    job fits a local runtime; every node of a cluster reaches the storage and data. The checked
    splits, or a PipelineError before anything is recorded.

    Ray's start mostly waits on the processes it launches, so a helper thread meanwhile imports and
    checks the ``_target_`` callables and opens the MLflow store (a new SQLite store creates its
    tables): about 2.5 s that would otherwise come one after the other."""
    check_values(cfg)
    splits = source.prepare(cfg["source"])
    storage = cfg["storage"]["path"]
    if storage is not None:
        train.check_storage(storage, cfg["storage"]["s3"])
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="preflight") as helper:
        checked = helper.submit(check_targets_then_open_store, cfg)
        cluster.connect(cfg["ray"])
        checked.result()
    if cfg["ray"]["address"] is None:  # a cluster may autoscale; a local runtime never grows
        transform_steps = [s for split in cfg["transforms"].values() for s in active_steps(split).values()]
        transform_cpus = max((s["num_cpus"] for s in transform_steps), default=0)
        train.check_resources(ray.cluster_resources(), cfg["scaling"], transform_cpus)
    shared = {f"source.{name}": split.files[0] for name, split in splits.items() if split.local}
    cluster.check_shared(cfg["ray"]["address"], {**shared, "storage.path": storage})
    return splits


def check_targets_then_open_store(cfg: dict) -> None:
    """The ``_target_`` checks, then, if they pass, the MLflow store opened: later clients of the same
    store reuse it (MLflow caches a store per URI). It holds no run until one is started."""
    check_targets(cfg)
    tracking.connect(cfg["tracking"]["uri"], cfg["paths"]["outputs"])


def build_datasets(cfg: dict, splits: dict[str, source.Split]) -> dict:
    """Each split read lazily with its transforms chained on: nothing runs until a worker iterates."""
    src = cfg["source"]
    columns = [src["feature_column"], src["label_column"]]
    return {name: preprocess.dataset(split, cfg["transforms"][name], columns, src) for name, split in splits.items()}


def train_and_track(cfg: dict, job: Job, splits: dict, client, run_id: str, resume_from: str | None) -> list[dict]:
    """Build the datasets, train, and log each epoch as it is reported, exactly once."""
    datasets = build_datasets(cfg, splits)
    steps = train.steps_per_epoch(
        splits["train"].rows, cfg["scaling"]["num_workers"], cfg["ingest"]["batch_size"], cfg["ingest"]["drop_last"]
    )
    events = Queue(actor_options={"num_cpus": 0})
    history: list[dict] = []
    logged = tracking.logged_epochs(client, run_id)  # a resumed run already holds its first epochs
    preprocess.start_at_epoch(datasets["train"], max(logged, default=-1) + 1)

    def on_report(report: dict) -> dict:
        ranks = sorted(report["ranks"], key=lambda r: r["rank"])
        check_ranks_agree(ranks)
        metrics = ranks[0]
        if metrics["epoch"] in logged:
            raise PipelineError(f"epoch {metrics['epoch']} was reported twice; its first metrics stand in MLflow.")
        logged.add(metrics["epoch"])
        tracking.log_epoch(client, run_id, metrics, metrics["epoch"])
        if not history:  # how long the command took to reach its first training step
            client.log_metric(run_id, "startup_s", metrics["first_step_at"] - job.started_at, step=metrics["epoch"])
        skipped = missing_rows(metrics, splits, cfg["scaling"]["num_workers"], cfg["ingest"]["drop_last"])
        if skipped:
            client.log_metric(run_id, "skipped_rows", skipped, step=metrics["epoch"])
            log.warning(
                "epoch %d: %d row(s) never reached training (skipped by a transform; Ray's worker logs name them)",
                metrics["epoch"] + 1,
                skipped,
            )
        with open(os.path.join(job.run_dir, "metrics.jsonl"), "a") as out:
            out.write(json.dumps({"checkpoint": report["checkpoint"], "ranks": ranks}) + "\n")
        history.append(metrics)
        return metrics

    try:
        storage = train.run_storage(cfg["storage"], job.run_dir, run_id, resume_from)
        client.set_tag(run_id, tracking.STORAGE_TAG, storage.uri)
        trainer = train.build_trainer(cfg, datasets, storage, steps, events)
        on_restore = functools.partial(tracking.log_restore, client, run_id)
        with console.follow(events, cfg["train"]["epochs"], steps, on_report, on_restore):
            try:
                result = train.fit(trainer)
            except ray.train.WorkerGroupError as err:
                raise explain(err) from err
        if not history:
            raise PipelineError("training finished without reporting an epoch.")
        if cfg["tracking"]["log_model"] and result.checkpoint is not None:
            with result.checkpoint.as_directory() as path:
                tracking.log_model(client, run_id, os.path.join(path, train.CHECKPOINT_FILE))
    finally:
        ray.kill(events.actor)
        if logged:
            tracking.log_learning_curve(client, run_id)
    return history


def run(cfg: dict, job: Job) -> dict:
    """Run one experiment from its resolved config; returns the last epoch's metrics."""
    job.run_dir = os.path.abspath(job.run_dir)
    console.quiet_libraries()

    def open_run() -> tuple:
        """The store and this job's run in it, created (or, to resume, reopened) only once there is
        something to record. Returns the client, the store's URI, the run id and, when resuming, the
        checkpoint location the run recorded."""
        client, uri = tracking.connect(cfg["tracking"]["uri"], cfg["paths"]["outputs"])
        experiment_id = tracking.experiment_id(
            client, uri, cfg["tracking"]["experiment_name"] or job.experiment, cfg["paths"]["outputs"]
        )
        if cfg["train"]["resume"]:
            run_id, resume_from = tracking.reopen_run(client, experiment_id, cfg["tracking"]["run_name"])
            return client, uri, run_id, resume_from
        parent = tracking.sweep_parent(client, experiment_id, job.sweep_dir) if job.sweep_dir else None
        run_id = tracking.start_run(
            client, experiment_id, cfg["tracking"]["run_name"] or job.run_name, parent, job.overrides, CODE_DIR
        )
        tracking.log_config(client, run_id, cfg)
        return client, uri, run_id, None

    try:
        splits = preflight(cfg)
    except PipelineError as err:
        if job.sweep_dir:  # a sweep keeps a record of every job it tried
            client, _, run_id, _ = open_run()
            tracking.end_run(client, run_id, "FAILED", err)
        raise
    os.makedirs(job.run_dir, exist_ok=True)
    client, uri, run_id, resume_from = open_run()
    log.info("MLflow run %s in %s; outputs in %s", run_id, tracking.redact(uri), job.run_dir)
    try:
        with tracking.recorded(client, run_id):
            history = train_and_track(cfg, job, splits, client, run_id, resume_from)
    except (KeyboardInterrupt, SystemExit):  # Ctrl-C, SIGTERM
        name = client.get_run(run_id).info.run_name
        log.warning(
            "interrupted: MLflow run %r ended KILLED; its checkpoints stay. Continue it with the same "
            "command plus: train.resume=true tracking.run_name=%s",
            name,
            name,
        )
        raise
    log.info(
        "finished: val_accuracy %.4f; browse with: mlflow ui --backend-store-uri %s",
        history[-1]["val_accuracy"],
        tracking.redact(uri),
    )
    return {k: history[-1][k] for k in EPOCH_METRICS}
