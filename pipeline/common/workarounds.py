"""Small workarounds for Ray's (2.60), MLflow's (3.17) and Hydra's (1.3.2 API, 1.3.8 installed) behaviour,
each naming the behaviour it targets and pinned by a canary that fails when that behaviour changes: in
``tests/test_ray_canaries.py``, or, for a submitted job's and a token cluster's, in ``tests/test_jobs.py``.

Workarounds that own a whole concern live with it: fit() off the main thread and the kept checkpoints
(:mod:`pipeline.training.trainer`), Ray's traceback text read for the user's error (``root_cause`` in
:mod:`pipeline.common.errors`), a lost GCS noticed (:mod:`pipeline.runtime.lifeline`) and the experiment
kind MLflow's UI opens (:mod:`pipeline.tracking.mlflow_store`).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import re
import signal
import socket
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING

import psutil

if TYPE_CHECKING:  # not at run time: Hydra's plugins import this module for every command, before it composes
    import ray  # the config, and Ray Data's tasks import it too; Ray's, Ray Train's and torch's imports take seconds
    import ray.data
    import ray.train


@contextlib.contextmanager
def global_tracking_uri(uri: str):
    """MLflow's global tracking URI set to ``uri`` while the block runs, then back as it was.

    MLflow 3.17: a model version whose source is ``models:/MODEL_ID`` (a LoggedModel: what links the
    version to it in the UI) is looked up by the SQL registry in the global tracking URI's store, not in
    the calling client's. Setting the global URI also exports ``MLFLOW_TRACKING_URI``, which a later
    job's ``tracking.uri`` would read: so it is put back at once.
    """
    import mlflow  # here: Ray Data's tasks import this module, and MLflow's import takes seconds

    before = os.environ.get("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(uri)
    try:
        yield
    finally:
        mlflow.set_tracking_uri(before)  # None unsets the variable


def system_metrics_monitor(run_id: str, interval_s: float, resume: bool, tracking_uri: str):
    """MLflow's system metrics (CPU, memory, disk, network, GPU) for a run the client API made, started.

    MLflow 3.17: the public switch (``mlflow.enable_system_metrics_logging``) covers only a run begun with
    ``mlflow.start_run``, the fluent API's one active run per process; the pipeline's runs are the client
    API's (created, resumed and ended by id, from the driver's threads). Its monitor class is internal
    (``mlflow.system_metrics``), so its use lives here, pinned by a canary in tests/test_ray_canaries.py."""
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    monitor = SystemMetricsMonitor(run_id, interval_s, resume_logging=resume, tracking_uri=tracking_uri)
    monitor.start()
    return monitor


def log_inputs(client, run_id: str, datasets: list) -> None:
    """``client.log_inputs``, once more when it lost a race to create the same dataset.

    MLflow 3.17's SQL store looks a dataset up, then inserts it when missing: two runs logging the same new
    dataset at once (a sweep's jobs starting together on a team's server) can both miss it, and the later insert
    fails on the unique key (PostgreSQL's UniqueViolation, SQLite's UNIQUE constraint). The dataset exists by
    then, so the second call links it. Canary: tests/test_ray_canaries.py races eight runs."""
    from mlflow.exceptions import MlflowException

    try:
        client.log_inputs(run_id, datasets=datasets)
    except MlflowException as err:
        if not any(text in str(err) for text in ("UniqueViolation", "UNIQUE constraint failed", "Duplicate entry")):
            raise
        client.log_inputs(run_id, datasets=datasets)


def import_mlflow_pytorch():
    """``mlflow.pytorch``, imported without its side effect on logging.

    MLflow 3.17: importing it calls ``logging.basicConfig(level=logging.ERROR)`` (its Lightning autolog
    module does), so in a process whose root logger has no handler yet (pytest, a notebook, a script
    calling the pipeline) every warning below ERROR was silenced from then on: the root logger is put
    back as it was."""
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    import mlflow.pytorch  # here: Ray Data's tasks import this module, and MLflow's import takes seconds

    root.setLevel(level)
    root.handlers[:] = handlers
    return mlflow.pytorch


def local_runtime_settings(num_cpus: int) -> None:
    """Environment for a local runtime of ``num_cpus`` logical CPUs, set before ``ray.init`` so every Ray process
    inherits it (Ray 2.60): no preemption watcher (a process of its own; nothing preempts one machine); the
    controller's health check every 0.5 s, not 2 s (each run, each Tune trial, ends up to 1.5 s sooner); and the
    raylet's worker-start limit sized to the logical CPUs, which the local runtime declares above the cores on
    purpose (``cluster.local_cpus``), as Ray sizes it on a machine with that many cores: without it, a run's 10
    actors and its tasks' processes pass 4x the limit and Ray warns. Canary: ``tests/test_ray_canaries.py``."""
    os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
    os.environ.setdefault("RAY_worker_maximum_startup_concurrency", str(num_cpus))


def in_a_lasting_thread(start: Callable[[], None]) -> Future:
    """``start`` (a local ``ray.init``, or joining a cluster) run in a daemon thread that then stays, parked, as
    long as the process; its outcome as a future.

    Ray 2.60: a local ``ray.init`` starts the GCS, the raylet and their helpers with ``PR_SET_PDEATHSIG``, which
    Linux ties to the thread that forked them, not the process: once a helper thread that started Ray ends, they
    are SIGKILLed, and the driver fails 60 s later ("Failed to connect to GCS"). Canary:
    ``tests/test_ray_canaries.py``."""
    outcome: Future = Future()

    def run() -> None:
        try:
            start()
        except BaseException as err:  # raised where the future is waited on
            outcome.set_exception(err)
            return
        outcome.set_result(None)
        threading.Event().wait()  # Ray's processes live while this thread does

    threading.Thread(target=run, name="ray-start", daemon=True).start()
    return outcome


STREAMED_BLOCK_BYTES = 16 * 2**20  # a generator task's yields of about this size leave it one by one


def streamed_blocks(ds: ray.data.Dataset) -> ray.data.Dataset:
    """``ds``, whose map tasks yield their rows in several batches, with each batch of over
    ``STREAMED_BLOCK_BYTES`` handed on as the task yields it.

    Ray 2.60: a map task's yields are merged into blocks of ``DataContext.target_max_block_size`` (128 MiB)
    before any leaves the task: a worker waited for some 850 decoded photos (seconds, at every epoch's
    start) before its first batch. A ``select_columns`` fused after such a task holds its whole output
    until it ends, whatever the block size (its block shaping is off): the pipeline keeps columns inside the
    task instead (:class:`pipeline.data.steps.Steps`). Canary: ``tests/test_ray_canaries.py``."""
    ds.context.target_max_block_size = STREAMED_BLOCK_BYTES
    return ds


class _TuneStateRenamedUnderUpload(logging.Filter):
    """Drops Tune's error for an upload of its experiment state that met a temp file renamed under it."""

    TEMP_FILE = re.compile(r"/\.[0-9a-f-]{36}-tmp-")  # Tune's atomic save: '.<uuid>-tmp-<name>', then renamed

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, FileNotFoundError) and self.TEMP_FILE.search(str(error)):
            logging.getLogger("pipeline").debug("Tune's state upload skipped a renamed temp file: %s", error)
            return False
        return True


_tune_state_filter = _TuneStateRenamedUnderUpload()


def quiet_tune_state_upload_race() -> None:
    """Keep one harmless race of Ray Tune's off the console, before a sweep starts.

    Ray 2.60: Tune writes its experiment state (each file through a temp file, then renamed) into a
    staging directory while its last upload of that directory may still run in a background thread. An
    upload that lists a temp file before the rename fails with FileNotFoundError, and Tune logs it as an
    error with a traceback although the sweep goes on and its next upload, and the last one, which Tune
    waits on, copy the whole state. Only that error is dropped. Canary: ``tests/test_ray_canaries.py``."""
    logging.getLogger("ray.tune.execution.experiment_state").addFilter(_tune_state_filter)  # once per filter


def in_submitted_job() -> bool:
    """Whether this process is a submitted Ray job's entrypoint (``ray job submit``, KubeRay's RayJob).

    Ray 2.60 says so in no public API before ``ray.init``: its job supervisor hands the entrypoint the
    job's runtime_env in ``RAY_JOB_CONFIG_JSON_ENV_VAR``, which ``ray.init`` merges with its own. Such an
    entrypoint runs in a temporary copy of the submitted working directory. Canary: a job of
    ``tests/test_jobs.py`` stopped by :func:`pipeline.runtime.checks.check_outlives_job`."""
    return "RAY_JOB_CONFIG_JSON_ENV_VAR" in os.environ


def refused_token(err: BaseException) -> bool:
    """Whether ``ray.init``'s failure to join a cluster was the cluster refusing this process's token.

    Ray 2.60 raises a ConnectionError whose cause, a RuntimeError, holds the AuthenticationError only as
    the text of a traceback (after about 20 connection attempts). Canary: ``tests/test_jobs.py``, joining a
    token cluster without RAY_AUTH_MODE=token."""
    import ray

    while err is not None:
        if isinstance(err, ray.exceptions.AuthenticationError) or "InvalidAuthToken" in str(err):
            return True
        err = err.__cause__ or err.__context__
    return False


RAYLET_AGENTS = ("ray::DashboardAgent", "ray::RuntimeEnvAgent")  # process titles


def end_agents_at_exit() -> None:
    """End the raylet's two agent processes with the command, right after a local ``ray.init``.

    Ray 2.60: at exit ``ray.shutdown`` gives the raylet 1 s to end after SIGTERM, then SIGKILLs it (on a
    loaded machine it needs longer). Its agents (``ray::DashboardAgent``, ``ray::RuntimeEnvAgent``) then
    take the raylet's end for a crash and report it to the GCS, which has ended too, and wait out that
    report's 60 s timeout: orphans of a command that has exited. This records them now; at exit, after
    shutting Ray down first, it ends those still running."""
    import ray

    agents = [p for p in psutil.Process().children(recursive=True) if process_title(p).startswith(RAYLET_AGENTS)]

    def end() -> None:
        ray.shutdown()
        for agent in agents:
            with contextlib.suppress(psutil.Error):
                if agent.is_running():  # still that process (psutil tells a reused pid apart)
                    agent.kill()

    atexit.register(end)  # before Ray's own shutdown at exit (atexit runs the newest first)


def process_title(process: psutil.Process) -> str:
    """A process's command line ("" once it is gone)."""
    try:
        return " ".join(process.cmdline())
    except psutil.Error:
        return ""


@contextlib.contextmanager
def own_sigterm_handler():
    """The process's SIGTERM handler (the pipeline's :func:`request_stop`) put back after the block.

    Ray 2.60: ``ray.init`` replaces a driver's SIGTERM handler with its own ``sys.exit``, behind its
    failure signal handler (absl's), which prints a stack trace and arms a 3 s alarm that aborts the
    process. Ending the MLflow run (the checkpoints' models saved, the learning curve) can take longer on
    a busy machine: the run stayed RUNNING. The pipeline's handler, put back, replaces both."""
    handler = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, handler)


def release_placement_group(group_id: str) -> None:
    """Remove a Tune trial's training placement group (hex id, as :func:`pipeline.training.worker.where_this_runs`
    reports it) once the trial has ended, if it is still there.

    Ray 2.60: a Tune scheduler that stops a trial (ASHA, median stopping) ends the trial's actor, and
    with it the Ray Train controller the trial started, before the controller removes its worker
    group's placement group. Ray Train's PlacementGroupCleaner would remove it, but it asks the state
    API, which needs the dashboard; without one (a local runtime) the group holds its CPUs until the
    sweep's process exits, and later trials wait for them forever.
    """
    import ray
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    group = PlacementGroup(ray.PlacementGroupID(bytes.fromhex(group_id)))
    if ray.util.placement_group_table(group).get("state") not in (None, "REMOVED"):
        remove_placement_group(group)


CONNECT_TIMEOUT_S = 5.0  # how long check_reachable waits for a cluster's address to answer


def check_reachable(address: str, unreachable: Callable[[str, Exception], Exception]) -> None:
    """Fail within seconds, with ``unreachable(address, err)``, when nothing listens at ``HOST:PORT`` (or
    ``ray://HOST:PORT``): Ray 2.60's ``ray.init`` retries an unreachable address for about a minute
    before it gives up. Pinned by the test of an unreachable ``ray.address`` (tests/test_pipeline.py)."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return  # "auto", or a form Ray resolves itself
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as err:
        raise unreachable(address, err) from err


def hydra_basic_plugins() -> tuple[type, type]:
    """Hydra's basic launcher and sweeper, which the pipeline's own extend (``pipeline/plugins``).

    Hydra 1.3 (1.3.8 installed) exports them only from ``hydra._internal.core_plugins``; a launcher that keeps its basic
    behaviour must subclass them there. Imported when Hydra loads the plugins, for every command."""
    from hydra._internal.core_plugins.basic_launcher import BasicLauncher
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    return BasicLauncher, BasicSweeper
