"""One job, start to end: config -> source -> transforms -> train -> tracking.

Every check that can fail on the user's input runs before Ray starts or an MLflow run exists, so
bad input leaves nothing behind.
"""
from __future__ import annotations

import json
import logging
import os
import re

import ray
from ray.util.queue import Queue

from pipeline import console, preprocess, source, tracking, train
from pipeline.config import PipelineError, active_steps, validate

log = logging.getLogger(__name__)


def start_ray(address: str | None, num_cpus: int | None) -> None:
    """Join ``address`` or start a local runtime, once per process (a sweep's jobs share it).

    Worker and Ray Data logs stay in Ray's session log files instead of the console.
    """
    if ray.is_initialized():
        return
    if address is None:  # nothing preempts a local runtime; the watcher costs a process start (~5 s)
        os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
    ray.init(
        address=address,
        num_cpus=num_cpus if address is None else None,
        log_to_driver=False,
        logging_level=logging.ERROR,
        include_dashboard=False,
    )


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
    lines = [line for line in str(err).splitlines()
             if re.match(r"^[A-Za-z_][\w.]*(Error|Exception)\b.*: ", line) and not line.startswith("ray.")]
    return lines[-1] if lines else f"{type(err).__name__}: {err}"


def explain(err: ray.train.WorkerGroupError) -> PipelineError:
    """One line per distinct cause, instead of Ray's truncated multi-rank snippet."""
    causes = sorted({root_cause(e) for e in err.worker_failures.values()})
    return PipelineError(
        f"training failed on rank(s) {sorted(err.worker_failures)}: {'; '.join(causes)} "
        "(full tracebacks: Ray's session logs, /tmp/ray/session_latest/logs on the head node)."
    )


def run(cfg: dict, run_dir: str, experiment: str, config_yaml: str) -> dict:
    """Run one experiment from its resolved config; returns the last epoch's metrics."""
    validate(cfg)
    splits = source.prepare(cfg["source"])
    run_dir = os.path.abspath(run_dir)
    os.makedirs(run_dir, exist_ok=True)

    console.quiet_libraries()
    start_ray(cfg["ray"]["address"], cfg["ray"]["num_cpus"])
    if cfg["ray"]["address"] is None:  # a cluster may autoscale; a local runtime never grows
        steps = [s for split in cfg["transforms"].values() for s in active_steps(split).values()]
        train.check_resources(ray.cluster_resources(), cfg["scaling"], max((s["num_cpus"] for s in steps), default=0))
    src = cfg["source"]
    columns = [src["feature_column"], src["label_column"]]
    datasets = {
        split: preprocess.apply(source.read(files, src["limit"], columns, src["reader_v2"]), cfg["transforms"][split])
        for split, (files, _) in splits.items()
    }
    train_rows = splits["train"][1]

    uri = tracking.resolve_uri(cfg["tracking"]["uri"], cfg["paths"]["outputs"])
    client, run_id = tracking.start_run(uri, cfg["tracking"]["experiment_name"] or experiment,
                                        cfg["tracking"]["run_name"], cfg["paths"]["outputs"])
    log.info("MLflow run %s in %s; outputs in %s", run_id, uri, run_dir)
    events = Queue(actor_options={"num_cpus": 0})
    history: list[dict] = []

    def on_report(report: dict) -> dict:
        ranks = sorted(report["ranks"], key=lambda r: r["rank"])
        check_ranks_agree(ranks)
        metrics = ranks[0]
        tracking.log_epoch(client, run_id, metrics, metrics["epoch"])
        with open(os.path.join(run_dir, "metrics.jsonl"), "a") as out:
            out.write(json.dumps({"checkpoint": report["checkpoint"], "ranks": ranks}) + "\n")
        history.append(metrics)
        return metrics

    try:
        tracking.log_config(client, run_id, cfg, config_yaml)
        steps = train.steps_per_epoch(train_rows, cfg["scaling"]["num_workers"],
                                      cfg["ingest"]["batch_size"], cfg["ingest"]["drop_last"])
        trainer = train.build_trainer(cfg, datasets, run_dir, steps, events)
        with console.follow(events, cfg["train"]["epochs"], steps, on_report):
            try:
                result = trainer.fit()
            except ray.train.WorkerGroupError as err:
                raise explain(err) from err
        if not history:
            raise PipelineError("training finished without reporting an epoch.")
        if cfg["tracking"]["log_model"] and result.checkpoint is not None:
            with result.checkpoint.as_directory() as path:
                tracking.log_model(client, run_id, os.path.join(path, train.CHECKPOINT_FILE))
    except KeyboardInterrupt:
        tracking.end_run(client, run_id, "KILLED")
        raise
    except BaseException:
        tracking.end_run(client, run_id, "FAILED")
        raise
    finally:
        ray.kill(events.actor)
    tracking.end_run(client, run_id, "FINISHED")
    log.info("finished: val_accuracy %.4f; browse with: mlflow ui --backend-store-uri %s",
             history[-1]["val_accuracy"], uri)
    return {k: history[-1][k] for k in tracking.EPOCH_METRICS}
