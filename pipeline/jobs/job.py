"""Where a job sits (:class:`Job`: its output directory, experiment, sweep) and what it hands back
(:class:`JobResult`), with the names and records a job writes beside its outputs."""

from __future__ import annotations

import json
import os
import time
from dataclasses import KW_ONLY, dataclass, field

from pipeline.common.startup import Startup


@dataclass
class Job:
    """Where a job sits: its output directory, experiment name and, in a sweep, the sweep's directory."""

    run_dir: str
    experiment: str
    _: KW_ONLY
    overrides: list[str] = field(default_factory=list)
    sweep_dir: str | None = None  # set for the jobs of a Hydra multirun
    run_name: str | None = None
    # where startup_s counts from: pipeline.STARTED_AT for a command's first job, its own start for a sweep's later ones
    started_at: float = field(default_factory=time.time)
    startup: Startup = field(default_factory=Startup)  # when each phase of its start-up ended

    @classmethod
    def in_sweep(cls, sweep_dir: str, number: int, experiment: str, overrides: list[str]) -> Job:
        """Job ``number`` of a Hydra multirun, in ``<sweep_dir>/<number>``, its run named for its overrides."""
        sweep_dir = os.path.abspath(sweep_dir)
        name = run_name("job", number, experiment, overrides)
        return cls(
            os.path.join(sweep_dir, str(number)), experiment, overrides=overrides, sweep_dir=sweep_dir, run_name=name
        )


@dataclass
class JobResult:
    """What a job hands back to its caller (``pipeline.train``, the command line, a sweep)."""

    run_id: str  # the job's MLflow run
    metrics: dict[str, float]  # a training run's last epoch; a prediction's scores
    model_uri: str | None = None  # a training run's best LoggedModel (``models:/ID``), when tracking.log_model
    predictions: str | None = None  # a prediction's files: a directory, local or s3://


def run_name(kind: str, number: int, experiment: str, overrides: list[str]) -> str:
    """A sweep's child run's name, its kind and number, then its overrides less the experiment's:
    ``job 3: optim.lr=0.001``, ``trial 2: model=mlp optim.lr=0.0012``."""
    shown = " ".join(o for o in overrides if o != f"+experiment={experiment}")
    return f"{kind} {number}: {shown}".strip()


def append_record(directory: str, name: str, record: dict) -> None:
    """One JSON line appended to ``directory/name``: a job's records beside its outputs (``metrics.jsonl``,
    each epoch's report; ``workers.jsonl``, where each worker ran)."""
    with open(os.path.join(directory, name), "a") as out:
        out.write(json.dumps(record, default=str) + "\n")
