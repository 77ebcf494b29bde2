"""``hydra/launcher=ray_jobs`` (on the user's machine): each job of a Hydra multirun submitted to the cluster at
``RAY_ADDRESS`` as a Ray job through the Jobs SDK, the working directory as its runtime environment, at most
``max_concurrent`` at once, each followed to its end. Each job is the same ``python -m pipeline`` command a user
would submit by hand, told which sweep it belongs to (:data:`SWEEP_DIR_ENV`, :data:`SWEEP_JOB_ENV`), so its MLflow
run is a child of the sweep's parent on the team's tracking server; a failed job is a FAILED child and the sweep goes
on; Ctrl-C or SIGTERM stops every job it submitted. The sweep's summary is the multirun callback's, as for any sweep.
"""

from __future__ import annotations

import logging
import os
import shlex
import time
from dataclasses import dataclass

from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from hydra.errors import ConfigCompositionException
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from pipeline.common import workarounds
from pipeline.common.errors import PipelineError, redact
from pipeline.config import experiment_choice
from pipeline.jobs import sweep
from pipeline.runtime.filesystems import local_store
from pipeline.tracking import mlflow_store

log = logging.getLogger("pipeline")

SWEEP_DIR_ENV = "PIPELINE_SWEEP_DIR"  # a submitted job's sweep (the parent run's tag) ...
SWEEP_JOB_ENV = "PIPELINE_SWEEP_JOB"  # ... and its number in it: pipeline/__main__.py reads both
PASSED_ENV = ("MLFLOW_TRACKING_URI", "PIPELINE_DATA_DIR")  # from this shell to every job, where set
EXCLUDES = [".git", ".venv", "outputs", "multirun", "__pycache__", "*.egg-info"]  # not uploaded with the code
ENDED = ("SUCCEEDED", "FAILED", "STOPPED")


@dataclass(kw_only=True)
class Settings:
    """``hydra.launcher``'s settings (conf/hydra/launcher/ray_jobs.yaml, with their comments)."""

    address: str | None
    max_concurrent: int
    poll_s: float
    env_vars: dict[str, str]


@dataclass
class Submitted:
    number: int
    overrides: list[str]
    id: str
    status: str = "PENDING"


def launch(config: DictConfig, loader, job_overrides, first: int, settings: Settings) -> list[JobReturn]:
    """Every job of the batch as a Ray job, ``max_concurrent`` at once, until each has ended; a JobReturn for each
    (its ``optimized_metric``, or None for a failed job) so that the sweep goes on."""
    from ray.job_submission import JobSubmissionClient  # Ray's imports only once a sweep launches

    if settings.max_concurrent < 1:
        raise PipelineError(f"hydra.launcher.max_concurrent must be >= 1, got {settings.max_concurrent}.")
    store = team_store(config)
    client = jobs_api(JobSubmissionClient, settings.address)  # before the parent run: a refusal leaves no run
    sweep_dir = os.path.abspath(config.hydra.sweep.dir)
    os.makedirs(sweep_dir, exist_ok=True)
    parent = store.sweep_parent(sweep_dir)  # made here, once, before jobs race to make it
    queue, running, ended = [], [], []
    for offset, overrides in enumerate(job_overrides):
        number, overrides = first + offset, list(overrides)
        try:
            loader.load_sweep_config(config, overrides)  # a job that does not compose is never submitted
        except (ConfigCompositionException, OmegaConfBaseException) as err:
            ended.append((number, sweep.record_uncomposable(config, overrides, number, err)))
            continue
        queue.append((number, overrides))
    try:
        while queue or running:
            while queue and len(running) < settings.max_concurrent:
                running.append(submit(client, config, sweep_dir, *queue.pop(0), settings))
            time.sleep(settings.poll_s)
            for job in list(running):
                job.status = str(client.get_job_status(job.id).value)
                if job.status in ENDED:
                    running.remove(job)
                    ended.append((job.number, finished(client, config, store, parent, job)))
    except BaseException as err:  # Ctrl-C, SIGTERM (pipeline.common.signals), a lost cluster: stop what runs, then go
        stop_all(client, running)
        stopped = isinstance(err, (KeyboardInterrupt, SystemExit))
        error = None if stopped else redact(mlflow_store.error_text(err))
        mlflow_store.end_run(store.client, parent, "KILLED" if stopped else "FAILED", error)
        raise
    return [result for _, result in sorted(ended, key=lambda pair: pair[0])]


def team_store(config: DictConfig) -> mlflow_store.Store:
    """The sweep's MLflow store, which must be one the cluster's jobs reach: a server or a database, not a file."""
    if local_store(config.tracking.uri, config.paths.outputs) is not None:
        raise PipelineError(
            f"hydra/launcher=ray_jobs: each job runs on the cluster, so its run must go to a tracking server or "
            f"database every node reaches; tracking.uri is {config.tracking.uri or 'unset'} (a file on this "
            "machine). Export MLFLOW_TRACKING_URI=http://<server>:5000 (or set tracking.uri) for the team's server."
        )
    experiment = experiment_choice(config.hydra.runtime.choices)
    return mlflow_store.Store.open(config.tracking, config.paths.outputs, experiment, create=True)


def jobs_api(client_class, address: str | None):
    """Ray's Jobs API at ``address``, or one paragraph saying why not (a token refused, nothing answering)."""
    try:
        return client_class(address)
    except Exception as err:
        if workarounds.refused_token(err):
            raise PipelineError(
                f"hydra/launcher=ray_jobs: the cluster's Jobs API at {address} refused this process: it sent no "
                "token or the wrong one. Export RAY_AUTH_MODE=token with the cluster's token in ~/.ray/auth_token "
                "(or RAY_AUTH_TOKEN), as for `ray job submit` (docs/cluster.md)."
            ) from None
        raise PipelineError(
            f"hydra/launcher=ray_jobs: cannot reach a Ray cluster's Jobs API at {address!r} ({err}). Set RAY_ADDRESS "
            "(or hydra.launcher.address) to the head's dashboard, http://HEAD:8265, and check it is up."
        ) from err


def submit(client, config: DictConfig, sweep_dir: str, number: int, overrides: list[str], settings: Settings):
    """Job ``number`` as a Ray job: ``python -m pipeline OVERRIDES`` in the uploaded working directory."""
    cwd = config.hydra.runtime.cwd
    run_dir = os.path.relpath(os.path.join(sweep_dir, str(number)), cwd)
    if run_dir.startswith(".."):  # a sweep directory outside the project: its place on the node, relative
        run_dir = os.path.join("multirun", os.path.basename(sweep_dir), str(number))
    env = {name: os.environ[name] for name in PASSED_ENV if name in os.environ}
    env |= {**settings.env_vars, SWEEP_DIR_ENV: sweep_dir, SWEEP_JOB_ENV: str(number)}
    command = ["python", "-m", "pipeline", *overrides, f"hydra.run.dir={run_dir}"]
    job_id = client.submit_job(
        entrypoint=shlex.join(command),
        runtime_env={"working_dir": cwd, "excludes": EXCLUDES, "env_vars": env},
        metadata={"sweep": sweep_dir, "job": str(number)},
    )
    log.info("job %d: Ray job %s submitted (ray job logs -f %s): %s", number, job_id, job_id, " ".join(overrides))
    return Submitted(number, overrides, job_id)


def finished(client, config: DictConfig, store, parent: str, job: Submitted) -> JobReturn:
    """An ended Ray job as Hydra's JobReturn: its child run's ``optimized_metric``, None when it failed (the run is
    FAILED, recorded by the job; the tail of its log is shown here)."""
    value = None
    if job.status == "SUCCEEDED":
        value = child_metric(store, parent, job.number, config.optimized_metric)
        log.info("job %d: Ray job %s SUCCEEDED (%s %s)", job.number, job.id, config.optimized_metric, value)
    else:
        tail = client.get_job_logs(job.id)[-2000:]
        log.error("job %d: Ray job %s %s; the end of its log:\n%s", job.number, job.id, job.status, tail)
    result = JobReturn(overrides=filter_overrides(job.overrides), status=JobStatus.COMPLETED)
    result.return_value = value
    return result


def child_metric(store, parent: str, number: int, metric: str) -> float | None:
    """The last ``metric`` of job ``number``'s child run under ``parent`` (named ``job N: overrides``, ``run_name``)."""
    children = store.client.search_runs(
        [store.experiment_id], filter_string=f"tags.`{MLFLOW_PARENT_RUN_ID}` = '{parent}'"
    )
    for child in children:
        if child.info.run_name.split(":")[0] == f"job {number}":
            return child.data.metrics.get(metric)
    return None


def stop_all(client, running: list[Submitted], wait_s: float = 60.0) -> None:
    """Stop every job still running (Ray sends each SIGTERM: it checkpoints and records KILLED), and wait for them."""
    for job in running:
        log.warning("stopping job %d: Ray job %s", job.number, job.id)
        client.stop_job(job.id)
    deadline = time.monotonic() + wait_s
    while running and time.monotonic() < deadline:
        running = [job for job in running if str(client.get_job_status(job.id).value) not in ENDED]
        time.sleep(1)
    for job in running:
        log.warning("job %d: Ray job %s had not stopped after %.0f s", job.number, job.id, wait_s)
