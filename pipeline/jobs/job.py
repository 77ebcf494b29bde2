"""One training job, built on the driver in the order its parts depend on each other: where it sits
(:class:`Job`), its checked sources (here), its datasets (:func:`pipeline.data.preprocess.training_data`),
its checkpoint storage (:func:`pipeline.runtime.filesystems.run_storage`), the weights it starts from
(:func:`start_weights`), then training
(:func:`pipeline.training.trainer.fit`). A run (``train.py``) and a Tune trial (``trial.py``, in a trial actor)
both build theirs with these functions.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import KW_ONLY, dataclass, field

from pipeline.common.errors import PipelineError
from pipeline.config import PipelineConfig, check_values
from pipeline.data import source, steps
from pipeline.training import finetune


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


def sources(cfg: PipelineConfig) -> dict[str, source.Split]:
    """The config's values checked, then its splits found and their files' footers read: every check
    that needs neither Ray nor the job's MLflow run. Each split carries its active transform steps."""
    active = {name: cfg.transforms.active(name) for name in source.SPLITS}
    check_values(cfg)
    for name in source.SPLITS:
        steps.check_streamed(name, active[name])
    splits = source.prepare(cfg.source)
    for name, split in splits.items():
        split.steps = active[name]
    return splits


def transform_cpus(splits: dict[str, source.Split]) -> float:
    """The most CPUs one transform step of the job asks for (0 without steps)."""
    return max((s.num_cpus for split in splits.values() for s in split.steps.values()), default=0)


def start_weights(cfg: PipelineConfig) -> finetune.Initial | None:
    """The weights a job starts from (``finetune.weights``, read and matched to the model), or None. An
    MLflow model is downloaded from the job's store first."""
    from pipeline.tracking import mlflow_store, models  # MLflow's imports, only for a job that starts from weights

    weights = cfg.finetune.weights
    with tempfile.TemporaryDirectory() as tmp:
        files = None
        if weights is not None and weights.startswith(models.MODEL_URI_SCHEMES):
            client, _ = mlflow_store.connect(cfg.tracking.uri, cfg.paths.outputs)
            try:
                files = models.model_weights(client, weights, tmp)
            except PipelineError as err:
                raise PipelineError(f"finetune.weights: {err}") from err
        return finetune.initial_weights(cfg.model, cfg.finetune, files)
