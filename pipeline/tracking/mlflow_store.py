"""The MLflow store and the life of its runs (on the driver): connecting (a tracking server that does not
answer fails within seconds), the experiment, creating a run (nested under a sweep's parent, tagged with the
overrides and the code's commit), reopening one to resume it, and ending it FINISHED, FAILED or KILLED.
Everything goes through ``MlflowClient`` with an explicit run id, so no global "active run" state leaks
between the jobs of a sweep or into worker processes. What a run holds is :mod:`pipeline.tracking.tracker`'s.
"""

from __future__ import annotations

import logging
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import requests
from mlflow import MlflowClient
from mlflow.entities import RunStatus
from mlflow.exceptions import MlflowException
from mlflow.utils.mlflow_tags import MLFLOW_GIT_COMMIT, MLFLOW_PARENT_RUN_ID

from pipeline.common.errors import PipelineError, redact
from pipeline.config import TrackingConfig
from pipeline.runtime.filesystems import local_store
from pipeline.tracking.liveness import (
    DRIVER_TAG,
    ORPHAN,
    STALE_S,
    health,
    judge,
    say_undecided,
    server_time,
    this_driver,
)

CODE_DIR = str(Path(__file__).resolve().parent)
MAX_TAG_LENGTH = 5000  # MLflow rejects longer tag values
SWEEP_DIR_TAG = "pipeline.sweep_dir"
OVERRIDES_TAG = "pipeline.overrides"
ERROR_TAG = "pipeline.error"
STORAGE_TAG = "pipeline.storage"  # where Ray Train keeps this run's checkpoints

log = logging.getLogger(__name__)


def resolve_uri(uri: str | None, outputs: str) -> str:
    """``tracking.uri`` (MLFLOW_TRACKING_URI feeds it), else an SQLite store in the outputs directory."""
    return uri or f"sqlite:///{Path(local_store(None, outputs)).resolve()}"


def connect(uri: str | None, outputs: str) -> tuple[MlflowClient, str]:
    """A client for the store :func:`resolve_uri` names (creating the outputs directory it lives in),
    with the store opened: a new SQLite store creates its tables here, the first time only."""
    resolved = resolve_uri(uri, outputs)
    if uri is None:
        os.makedirs(outputs, exist_ok=True)
    if resolved.startswith(("http://", "https://")):
        check_server(resolved)
    client = MlflowClient(tracking_uri=resolved)
    try:
        client.search_experiments(max_results=1)
    except MlflowException as err:
        raise PipelineError(f"tracking.uri: the MLflow store at {redact(resolved)} failed: {err.message}") from err
    return client, resolved


UI_ADDRESS = "http://127.0.0.1:5000"  # where `mlflow ui` serves by default
# What the experiment holds: MLflow lists it as "Machine learning". MLflow 3.17.2's UI still opens every
# experiment in its GenAI view (it takes the view from the URL, else the browser's last choice, and reads this
# tag only without its GenAI / Model training switch), so links carry the view (the browser test pins it).
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")
UI_VIEW = "workflowType=machine_learning"  # the UI's "Model training" view


def run_link(uri: str, run_id: str) -> str:
    """How to see a run in MLflow's UI: its page, in the training view, on the tracking server, or on the
    ``mlflow ui`` a file store needs (the command to start it first)."""
    experiment = MlflowClient(uri).get_run(run_id).info.experiment_id
    page = f"#/experiments/{experiment}/runs/{run_id}?{UI_VIEW}"
    if uri.startswith(("http://", "https://")):
        return f"see it at {redact(uri).rstrip('/')}/{page}"
    return f"see it with `mlflow ui --backend-store-uri {redact(uri)}` at {UI_ADDRESS}/{page}"


def check_server(uri: str) -> None:
    """Fail within seconds when no MLflow server answers at ``uri``: MLflow's client retries an
    unreachable server with backoff for minutes before it gives up. Any HTTP answer will do."""
    try:
        health(uri)
    except requests.RequestException as err:
        raise PipelineError(
            f"tracking.uri: no MLflow tracking server answers at {redact(uri)} ({type(err).__name__}). Start it "
            "(mlflow server --host 127.0.0.1 --port 5000 --backend-store-uri ...), correct tracking.uri or "
            "MLFLOW_TRACKING_URI, or unset both to log to the SQLite store in paths.outputs."
        ) from None  # the chained error repeats the URI, password included


def experiment_id(client: MlflowClient, uri: str, name: str, outputs: str) -> str:
    """The experiment's id, created on first use and tagged as model training (``EXPERIMENT_KIND``; an older
    one without a kind gets it); with the embedded SQLite store its artifacts go beside the store in
    ``<outputs>/mlartifacts``."""
    kind, training = EXPERIMENT_KIND
    found = client.get_experiment_by_name(name)
    if found is not None:
        if kind not in found.tags:
            client.set_experiment_tag(found.experiment_id, kind, training)
        return found.experiment_id
    artifacts = (Path(outputs).resolve() / "mlartifacts").as_uri() if uri.startswith("sqlite:") else None
    return client.create_experiment(name, artifact_location=artifacts, tags={kind: training})


@dataclass
class Store:
    """The MLflow store and experiment a job's runs go to (``tracking.experiment_name``, else the job's
    ``+experiment``). :class:`Tracker`'s constructors are the only code that creates or reopens a run."""

    client: MlflowClient
    uri: str
    name: str
    experiment_id: str | None  # None: no such experiment yet (opened with create=False)

    @classmethod
    def open(cls, tracking_cfg: TrackingConfig, outputs: str, experiment: str, create: bool = True) -> Store:
        client, uri = connect(tracking_cfg.uri, outputs)
        name = tracking_cfg.experiment_name or experiment
        if create:
            return cls(client, uri, name, experiment_id(client, uri, name, outputs))
        found = client.get_experiment_by_name(name)
        return cls(client, uri, name, found.experiment_id if found else None)

    def runs_where(self, key: str, value: str, **search) -> list:
        return runs_where(self.client, self.experiment_id, key, value, **search)

    def sweep_parent(self, sweep_dir: str) -> str:
        return sweep_parent(self.client, self.experiment_id, sweep_dir)


def runs_where(client: MlflowClient, experiment: str, key: str, value: str, **search) -> list:
    """Runs of ``experiment`` whose ``key`` (``run_name`` or a tag) is exactly ``value``, whatever quotes
    it holds: MLflow's filter strings have no escape, so the other quote encloses it, and a value
    with both kinds is matched with LIKE (``_`` for each ``'``) and compared exactly here."""
    field = "attributes.run_name" if key == "run_name" else f"tags.`{key}`"
    if "'" not in value:
        runs = client.search_runs([experiment], filter_string=f"{field} = '{value}'", **search)
    elif '"' not in value:
        runs = client.search_runs([experiment], filter_string=f'{field} = "{value}"', **search)
    else:
        search.pop("max_results", None)
        runs = client.search_runs([experiment], filter_string=f"{field} LIKE '{value.replace(chr(39), '_')}'", **search)
    return [r for r in runs if (r.info.run_name if key == "run_name" else r.data.tags.get(key)) == value]


def sweep_parent(client: MlflowClient, experiment: str, sweep_dir: str) -> str:
    """The parent run of a Hydra multirun, found by its sweep directory or created by its first job."""
    found = runs_where(client, experiment, SWEEP_DIR_TAG, sweep_dir, max_results=1)
    if found:
        return found[0].info.run_id
    name = "sweep " + "/".join(Path(sweep_dir).parts[-2:])
    return client.create_run(experiment, run_name=name, tags={SWEEP_DIR_TAG: sweep_dir}).info.run_id


def git_commit(path: str) -> str | None:
    """The commit of the code at ``path`` (with ``-dirty`` for uncommitted changes), if it is a checkout."""
    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty", "--abbrev=40", "--match=NeVeR"],
            cwd=path,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


def start_run(
    store: Store, run_name: str | None, parent: str | None, overrides: list[str], tags: dict[str, str] | None = None
) -> str:
    """Create a run (RUNNING), nested under ``parent``, tagged with the Hydra overrides, the code's git
    commit and ``tags``."""
    tags = {OVERRIDES_TAG: redact(" ".join(overrides))[:MAX_TAG_LENGTH], **(tags or {})}
    if parent is not None:
        tags[MLFLOW_PARENT_RUN_ID] = parent
    commit = git_commit(CODE_DIR)
    if commit is not None:
        tags[MLFLOW_GIT_COMMIT] = commit
    return store.client.create_run(store.experiment_id, run_name=run_name, tags=tags).info.run_id


def reopen(client: MlflowClient, run, driver: bool = False) -> str:
    """``run`` RUNNING again, without the error that ended it (it is in the past now); its id. ``driver``:
    held by this process from now on (:data:`DRIVER_TAG`)."""
    client.update_run(run.info.run_id, status="RUNNING")
    if driver:
        client.set_tag(run.info.run_id, DRIVER_TAG, this_driver())
    if ERROR_TAG in run.data.tags:
        client.delete_tag(run.info.run_id, ERROR_TAG)
    return run.info.run_id


def reopen_run(store: Store, run_name: str) -> tuple[str, str]:
    """The newest unfinished run named ``run_name``, set RUNNING again, and its checkpoint location."""
    found = store.runs_where("run_name", run_name, order_by=["attributes.start_time DESC"], max_results=1)
    if not found:
        raise PipelineError(
            f"train.resume=true: no run named {run_name!r} in this experiment to resume "
            "(tracking.run_name). Without train.resume a run always starts fresh."
        )
    run = found[0]
    if run.info.status == "FINISHED":
        raise PipelineError(
            f"train.resume=true: run {run_name!r} ({run.info.run_id}) already finished; start a new run instead."
        )
    if run.info.status == "RUNNING":
        refuse_live_resume(store, run)
    if STORAGE_TAG not in run.data.tags:
        raise PipelineError(
            f"train.resume=true: run {run_name!r} ({run.info.run_id}) never reached training, "
            "so it has no checkpoint to resume from."
        )
    return reopen(store.client, run, driver=True), run.data.tags[STORAGE_TAG]


@contextmanager
def recorded(client: MlflowClient, run_id: str) -> Iterator[None]:
    """End the run when the block does: FINISHED, KILLED on Ctrl-C or SIGTERM (SystemExit), FAILED on
    any other error (its message kept as a tag)."""
    try:
        yield
    except BaseException as err:
        end_run(client, run_id, end_status(err), error_text(err))
        raise
    end_run(client, run_id, "FINISHED")


def end_status(error: BaseException | None) -> str:
    """FINISHED without an error, KILLED for Ctrl-C or SIGTERM (SystemExit), FAILED for any other."""
    if error is None:
        return "FINISHED"
    return "KILLED" if isinstance(error, (KeyboardInterrupt, SystemExit)) else "FAILED"


def error_text(error: BaseException) -> str:
    """An error as a run keeps it: its type and message."""
    return f"{type(error).__name__}: {error}"


def end_run(client: MlflowClient, run_id: str, status: str, error: str | None = None) -> None:
    """Close the run as FINISHED, FAILED or KILLED; a failure keeps its message (:func:`error_text`) as a tag."""
    if error is not None:
        client.set_tag(run_id, ERROR_TAG, error[:MAX_TAG_LENGTH])
    client.set_terminated(run_id, status=RunStatus.to_string(getattr(RunStatus, status)))


def refuse_live_resume(store: Store, run) -> None:
    """A resume of a RUNNING run goes on only once its driver is known gone (:func:`end_orphans` then ended it
    already), or where no driver holds it (an older version's run): two drivers would write one run and one
    storage. Refused in one paragraph, nothing written."""
    verdict = judge(run.data.tags, server_time(store.uri))
    if verdict.gone or verdict.driver is None:
        return
    driver = verdict.driver
    stop = (
        f"Stop {driver or 'its driver'} first (Ctrl-C there, ray job stop, or kill {driver.pid if driver else 'it'}: "
        "it checkpoints and ends the run KILLED), then resume."
    )
    about = f"train.resume=true: run {run.info.run_name!r} ({run.info.run_id})"
    if verdict.gone is False:
        wait = ""
        if verdict.silent_s is not None:
            wait = (
                f" If its machine is lost, wait: a driver silent for {STALE_S / 60:.0f} min is taken for gone and the "
                f"resume goes on then (in {max(STALE_S - verdict.silent_s, 0) / 60:.0f} min at the earliest)."
            )
        raise PipelineError(f"{about} is still running: {verdict.why}. {stop}{wait}")
    client = f"MlflowClient('{redact(store.uri)}')"
    raise PipelineError(
        f"{about} is RUNNING and this command cannot tell whether its driver lives: {verdict.why}. If it still runs, "
        f'stop it first. If it is gone, end the run in MLflow, then resume: python -c "from mlflow import '
        f"MlflowClient; {client}.set_terminated('{run.info.run_id}', 'KILLED')\""
    )


def end_orphans(client: MlflowClient) -> list[str]:
    """Runs left RUNNING by a driver that is gone (SIGKILL, the OOM killer, a crash, a lost machine: nothing ran
    to end them), in any experiment of the store, ended KILLED with the reason and how to continue; their ids.
    :func:`pipeline.tracking.liveness.judge` is the judge; a run it cannot judge is left as it is, and said so
    once. A command calls it as it opens the store."""
    experiments = [e.experiment_id for e in client.search_experiments()]
    if not experiments:
        return []
    held = client.search_runs(experiments, f"attributes.status = 'RUNNING' and tags.`{DRIVER_TAG}` LIKE '%'")
    now = server_time(client.tracking_uri) if held else None
    verdicts = [(run, judge(run.data.tags, now)) for run in held]
    say_undecided([(run, verdict) for run, verdict in verdicts if verdict.gone is None])
    orphans = [(run, verdict) for run, verdict in verdicts if verdict.gone]
    for run, verdict in orphans:
        why = f"{verdict.why} without ending it (killed, crashed, or its machine lost)"
        end_run(client, run.info.run_id, "KILLED", f"{ORPHAN}: {why}; ended by a later command (pid {os.getpid()})")
        continued = ""
        if STORAGE_TAG in run.data.tags:  # it reached training: its checkpoints stay
            command = f"python -m pipeline {run.data.tags.get(OVERRIDES_TAG, '')}".rstrip()
            continued = f" Continue it with: {command} train.resume=true tracking.run_name={run.info.run_name}"
            if not verdict.driver or not verdict.driver.here():  # silent: perhaps only cut off from the server
                continued += f" (if {verdict.driver or 'its driver'} still runs, stop it first)"
        log.warning(
            "MLflow run %r (%s) was left RUNNING: %s. Ended KILLED.%s",
            run.info.run_name,
            run.info.run_id,
            why,
            continued,
        )
    return [run.info.run_id for run, _ in orphans]
