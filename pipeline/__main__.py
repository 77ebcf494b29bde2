"""``python -m pipeline +experiment=NAME [overrides]``: compose the config and run one job
(:func:`pipeline.api.run_job`, what ``pipeline.train`` runs from Python).

With ``-m`` (a Hydra multirun) every job runs here in turn, sharing one Ray runtime; a failed job
is logged and recorded, the sweep goes on, and :func:`pipeline.jobs.sweep.summarize_sweep` reports it.
"""

from __future__ import annotations

import logging
import os
import sys
import time

# Workaround, Ray 2.60: any Ray call once the command's runtime is shut down starts a new local one (ray.init on
# first use). A thread still polling after a failed run did so and held the command forever instead of exit 1 (the
# fault soak, seeds 4 and 15: the event queue's actor killed). Ray reads this as it is imported, so it is set here,
# before anything imports Ray; such a late call now raises. Canary: tests/test_ray_canaries.py.
os.environ.setdefault("RAY_ENABLE_AUTO_CONNECT", "0")

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

import pipeline
from pipeline.common.errors import PipelineError
from pipeline.config import check_overrides, experiment_choice, register

log = logging.getLogger("pipeline")
register()


def describe_job(hydra_cfg: DictConfig):
    """Where this job sits (a :class:`pipeline.jobs.job.Job`), from Hydra's runtime config; a job that
    ``hydra/launcher=ray_jobs`` submitted is a single run told its sweep and number by its environment."""
    from pipeline.jobs.job import Job
    from pipeline.jobs.ray_jobs import SWEEP_DIR_ENV, SWEEP_JOB_ENV

    overrides = list(hydra_cfg.overrides.task)
    experiment = experiment_choice(hydra_cfg.runtime.choices)
    if SWEEP_DIR_ENV in os.environ and hydra_cfg.mode != RunMode.MULTIRUN:
        job = Job.in_sweep(os.environ[SWEEP_DIR_ENV], int(os.environ[SWEEP_JOB_ENV]), experiment, overrides)
        job.run_dir, job.started_at = hydra_cfg.runtime.output_dir, pipeline.STARTED_AT
        return job
    if hydra_cfg.mode != RunMode.MULTIRUN:
        return Job(hydra_cfg.runtime.output_dir, experiment, overrides=overrides, started_at=pipeline.STARTED_AT)
    job = Job.in_sweep(hydra_cfg.sweep.dir, hydra_cfg.job.num, experiment, overrides)
    job.run_dir = hydra_cfg.runtime.output_dir  # hydra.sweep.subdir may name it otherwise
    job.started_at = time.time() if hydra_cfg.job.num > 0 else pipeline.STARTED_AT
    return job


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(raw: DictConfig) -> float | None:
    # The stages import torch, Ray and MLflow, seconds of work: only once Hydra has composed the config,
    # so that a mistyped override or experiment fails at once.
    from pipeline.api import run_job
    from pipeline.common import signals

    job = describe_job(HydraConfig.get())
    signals.install()  # Ctrl-C and SIGTERM (exit 143) both end the run as KILLED
    try:
        result = run_job(raw, job)
    except KeyboardInterrupt:  # Ctrl-C: the job recorded it; a sweep stops here too
        sys.exit(130)
    except Exception as err:
        if HydraConfig.get().mode != RunMode.MULTIRUN:  # a single run, or a Ray job of a sweep: exit 1
            if isinstance(err, PipelineError):
                log.error("%s", err)
                sys.exit(1)
            raise
        # A sweep goes on: the job is a FAILED child run; None tells Optuna the trial failed.
        (log.error if isinstance(err, PipelineError) else log.exception)("job failed: %s", err)
        return None
    return result.metrics.get(raw.optimized_metric)


if __name__ == "__main__":
    try:  # override mistakes Hydra would report as a traceback, as one paragraph
        check_overrides(sys.argv[1:])
    except PipelineError as err:
        sys.exit(f"error: {err}")
    main()
