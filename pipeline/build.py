"""One training job, built on the driver in the order its parts depend on each other: where it sits
(:class:`Job`), its checked sources, its datasets, its checkpoint storage, then training. A run
(``run.py``) and a Tune trial (``trial.py``, in a trial actor) both build theirs with these functions.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import ray
from ray.exceptions import RayError

from pipeline import preprocess, source, workarounds
from pipeline.config import PipelineError, active_steps, check_values


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


def sources(cfg: dict) -> dict[str, source.Split]:
    """The config's values checked, then its splits found and their files' footers read: every check
    that needs neither Ray nor the job's MLflow run. Each split carries its active transform steps."""
    check_values(cfg)
    splits = source.prepare(cfg["source"])
    for name, split in splits.items():
        split.steps = active_steps(cfg["transforms"][name])
    return splits


def transform_cpus(splits: dict[str, source.Split]) -> float:
    """The most CPUs one transform step of the job asks for (0 without steps)."""
    return max((s["num_cpus"] for split in splits.values() for s in split.steps.values()), default=0)


@contextmanager
def datasets(
    cfg: dict, splits: dict[str, source.Split], plan: preprocess.CachePlan | None = None
) -> Iterator[preprocess.TrainingData]:
    """The job's datasets while the job runs (with the cache on, its tasks are submitted here and run
    while training starts); the epoch counter they share is ended with the job. A transform that fails
    in a pass made now (``ingest.standardize``'s) fails the job here, in one line naming the cause."""
    try:
        data = preprocess.training_data(cfg, splits, plan)
    except RayError as err:
        raise PipelineError(
            f"preprocessing failed: {workarounds.root_cause(err)} (full tracebacks: Ray's session logs, "
            "/tmp/ray/session_latest/logs on the head node)."
        ) from err
    try:
        yield data
    finally:
        ray.kill(data.epoch_counter)
