"""Hydra multirun bookkeeping: when a sweep ends, mark its MLflow parent run with the best child,
print one line per job, and exit non-zero if any job failed.

Jobs report to MLflow themselves (see ``run.py``); this callback only reads the store back, so it
works whichever launcher ran the jobs.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from typing import Any

from hydra.experimental.callback import Callback
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID
from omegaconf import DictConfig

from pipeline import tracking

log = logging.getLogger("pipeline")


def better(metric: str) -> int:
    """+1 when a larger value of ``metric`` is better, -1 for losses."""
    return -1 if metric.endswith("loss") else 1


def summarize(client, experiment_id: str, parent: str, metric: str) -> tuple[list[dict], dict | None]:
    """Every child of the sweep's parent run, in job order, and the best finished one."""
    children = client.search_runs(
        [experiment_id],
        filter_string=f"tags.`{MLFLOW_PARENT_RUN_ID}` = '{parent}'",
        order_by=["attributes.start_time ASC"],
    )
    jobs = [
        {
            "run_id": child.info.run_id,
            "name": child.info.run_name,
            "status": child.info.status,
            "value": child.data.metrics.get(metric, math.nan),
            "overrides": child.data.tags.get(tracking.OVERRIDES_TAG, ""),
            "error": child.data.tags.get(tracking.ERROR_TAG, ""),
        }
        for child in children
    ]
    finished = [j for j in jobs if j["status"] == "FINISHED" and not math.isnan(j["value"])]
    best = max(finished, key=lambda j: better(metric) * j["value"]) if finished else None
    return jobs, best


def format_table(jobs: list[dict], metric: str) -> str:
    lines = [f"{'job':>4}  {'status':<8}  {metric:>12}  overrides"]
    for number, job in enumerate(jobs):
        lines.append(f"{number:>4}  {job['status']:<8}  {job['value']:>12.4f}  {job['overrides']}")
        if job["error"]:
            lines.append(f"{'':>4}  {job['error'][:300]}")
    return "\n".join(lines)


class SweepSummary(Callback):
    """Registered in ``conf/config.yaml`` under ``hydra.callbacks``."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        metric = config.optimized_metric
        sweep_dir = os.path.abspath(config.hydra.sweep.dir)
        client, uri = tracking.connect(config.tracking.uri, config.paths.outputs)
        name = config.tracking.experiment_name or config.hydra.runtime.choices.get("experiment") or "default"
        found = client.get_experiment_by_name(name)
        if found is None:
            log.error("sweep %s logged no runs to experiment %r in %s", sweep_dir, name, uri)
            sys.exit(1)
        parent = tracking.sweep_parent(client, found.experiment_id, sweep_dir)
        jobs, best = summarize(client, found.experiment_id, parent, metric)
        failed = [j for j in jobs if j["status"] != "FINISHED"]
        if best is not None:
            client.set_tag(parent, "pipeline.best_run_id", best["run_id"])
            client.set_tag(parent, "pipeline.best_run_name", best["name"])
            client.log_metric(parent, f"best_{metric}", best["value"])
        tracking.end_run(client, parent, "FAILED" if failed or best is None else "FINISHED")
        log.info("sweep %s: %d jobs, %d failed\n%s", sweep_dir, len(jobs), len(failed), format_table(jobs, metric))
        if best is not None:
            log.info("best: %s (%s %.4f)", best["name"], metric, best["value"])
        if failed:
            sys.exit(1)
