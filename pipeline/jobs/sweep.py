"""Hydra multirun bookkeeping (on the driver): a job whose overrides do not compose recorded as a
FAILED child run (for the launcher in ``pipeline/plugins/hydra_plugins``), and a callback that, when
the sweep ends, marks its MLflow parent run with the best child, prints one line per job, and exits
non-zero if any job failed.

Jobs report to MLflow themselves (see ``train.py``); the callback only reads the store back.
"""

from __future__ import annotations

import logging
import math
import os
import sys

from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID
from omegaconf import DictConfig, OmegaConf

from pipeline.common import console
from pipeline.common.errors import PipelineError
from pipeline.common.metrics import lower_is_better
from pipeline.config import experiment_choice, load
from pipeline.tracking import epochs, mlflow_store, models, tracker

log = logging.getLogger("pipeline")


def record_uncomposable(sweep_config: DictConfig, overrides: list[str], number: int, err: Exception) -> JobReturn:
    """A sweep job whose overrides do not compose, as a FAILED child of the sweep's parent run (with the
    sweep's base config and the error), and as a finished job to Hydra, so the sweep goes on."""
    from pipeline.jobs.job import Job  # the training stage's imports, only when a job has failed

    console.quiet_libraries()
    error = PipelineError("the overrides do not compose: " + " ".join(str(err.__cause__ or err).split()))
    log.error("job %d failed: %s", number, error)
    plain = OmegaConf.to_container(sweep_config, resolve=False)
    del plain["hydra"]
    cfg = load(OmegaConf.create(plain))
    experiment = experiment_choice(sweep_config.hydra.runtime.choices)
    job = Job.in_sweep(sweep_config.hydra.sweep.dir, number, experiment, filter_overrides(overrides))
    tracker.Tracker.open(cfg, job).end("FAILED", error)
    return JobReturn(overrides=overrides, status=JobStatus.COMPLETED)  # its return value: None, a failed job


def summarize(client, experiment_id: str, parent: str, metric: str, better: int) -> tuple[list[dict], dict | None]:
    """Every child of the sweep's parent run, in job order, and the best finished one (``better``: +1 when
    a larger value of ``metric`` is better, -1 for losses and errors)."""
    children = client.search_runs(
        [experiment_id],
        filter_string=f"tags.`{MLFLOW_PARENT_RUN_ID}` = '{parent}'",
        order_by=["attributes.start_time ASC"],
    )
    jobs = [
        {
            "run_id": child.info.run_id,
            "name": child.info.run_name,
            # a trial a Tune scheduler stopped early ended FINISHED: its table row says STOPPED
            "status": "STOPPED" if epochs.STOPPED_TAG in child.data.tags else child.info.status,
            "value": child.data.metrics.get(metric, math.nan),
            "overrides": child.data.tags.get(mlflow_store.OVERRIDES_TAG, ""),
            "error": child.data.tags.get(mlflow_store.ERROR_TAG, ""),
        }
        for child in children
    ]
    finished = [j for j in jobs if j["status"] in ("FINISHED", "STOPPED") and not math.isnan(j["value"])]
    best = max(finished, key=lambda j: better * j["value"]) if finished else None
    return jobs, best


def format_table(jobs: list[dict], metric: str) -> str:
    lines = [f"{'job':>4}  {'status':<8}  {metric:>12}  overrides"]
    for number, job in enumerate(jobs):
        lines.append(f"{number:>4}  {job['status']:<8}  {job['value']:>12.4f}  {job['overrides']}")
        if job["error"]:
            lines.append(f"{'':>4}  {job['error'][:300]}")
    return "\n".join(lines)


def summarize_sweep(config: DictConfig) -> None:
    """At a sweep's end (Hydra's callback, ``hydra_plugins.pipeline_launcher.SweepSummary``): the parent run
    marked with the best child and ended, one line per job, and a non-zero exit if any job failed."""
    metric = config.optimized_metric
    sweep_dir = os.path.abspath(config.hydra.sweep.dir)
    try:
        experiment = experiment_choice(config.hydra.runtime.choices)
        store = mlflow_store.Store.open(config.tracking, config.paths.outputs, experiment, create=False)
    except PipelineError as err:
        log.error("sweep %s: cannot summarize it: %s", sweep_dir, err)
        sys.exit(1)
    if store.experiment_id is None:
        log.error("sweep %s logged no runs to experiment %r in %s", sweep_dir, store.name, store.uri)
        sys.exit(1)
    client, parent = store.client, store.sweep_parent(sweep_dir)
    better = -1 if lower_is_better(config.task.type, list(config.task.metrics), metric) else 1
    jobs, best = summarize(client, store.experiment_id, parent, metric, better)
    failed = [j for j in jobs if j["status"] not in ("FINISHED", "STOPPED")]
    if best is not None:
        client.set_tag(parent, "pipeline.best_run_id", best["run_id"])
        client.set_tag(parent, "pipeline.best_run_name", best["name"])
        client.log_metric(parent, f"best_{metric}", best["value"])
        name = config.tracking.register_as
        version = models.registered_version(client, name, best["run_id"]) if name else None
        if version is not None:
            client.set_registered_model_alias(name, config.tracking.register_alias, version)
            log.info(
                "models:/%s@%s is version %s (job %s)", name, config.tracking.register_alias, version, best["name"]
            )
    mlflow_store.end_run(client, parent, "FAILED" if failed or best is None else "FINISHED")
    log.info("sweep %s: %d jobs, %d failed\n%s", sweep_dir, len(jobs), len(failed), format_table(jobs, metric))
    if best is not None:
        log.info("best: %s (%s %.4f)", best["name"], metric, best["value"])
    if failed:
        sys.exit(1)
