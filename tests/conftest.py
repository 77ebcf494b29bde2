"""Shared fixtures: small generated CIFAR-like parquet data, composed configs, one Ray runtime.

Ray must keep its traffic on 127.0.0.1, so the variable is set before anything imports Ray.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import os
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
# For the tests' Ray runtimes only, changing no result: keep up to 10 idle Ray worker processes instead of
# one per CPU, so a job's actors (Ray Train's controller, workers, Ray Data's coordinators) start in a
# finished task's process instead of a new one, which makes each job on a shared runtime about 3 s shorter
# here. (Not RAY_TRAIN_HEALTH_CHECK_INTERVAL_S: polling the workers faster ends a failing run before its
# other ranks report their error, so the error names fewer ranks.)
os.environ.setdefault("RAY_num_workers_soft_limit", "10")
# Tests never reach real AWS: fake credentials whose secret is random (the leak test searches every
# output for it), no profile, no instance-metadata lookups. Set before Ray starts, so workers inherit them.
AWS_SECRET = f"pipeline-test-secret-{secrets.token_hex(12)}"
os.environ.update(
    AWS_ACCESS_KEY_ID="pipeline-test-key",
    AWS_SECRET_ACCESS_KEY=AWS_SECRET,
    AWS_DEFAULT_REGION="us-east-1",
    AWS_EC2_METADATA_DISABLED="true",
)
for variable in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_SHARED_CREDENTIALS_FILE"):
    os.environ.pop(variable, None)
# A team's MLFLOW_TRACKING_URI or RAY_ADDRESS is not the tests' business: each test makes its own MLflow store and
# Ray runtime, and those that test the variables set them themselves.
for variable in ("MLFLOW_TRACKING_URI", "RAY_ADDRESS"):
    os.environ.pop(variable, None)

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
from PIL import Image

from pipeline.api import compose
from pipeline.config import register
from pipeline.jobs.job import Job
from pipeline.jobs.train import run

register()


def jpeg(image: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="JPEG", quality=95)
    return buffer.getvalue()


def photo(height: int, width: int, seed: int = 0) -> np.ndarray:
    """A smooth RGB image (gradients and a few blobs): JPEG keeps it close, resizing is comparable."""
    y, x = np.mgrid[0:height, 0:width] / max(height, width)
    rng = np.random.default_rng(seed)
    channels = [
        np.sin(6 * x * rng.uniform(0.5, 2) + rng.uniform(0, 6)) + np.cos(5 * y * rng.uniform(0.5, 2)) for _ in range(3)
    ]
    return np.clip(np.dstack(channels) * 60 + 128, 0, 255).astype(np.uint8)


# pytest-xdist hands whole files to its two processes in collection order (--no-loadscope-reorder): the
# longest files go first, so that neither process is left running a long one alone at the end.
LONGEST_FIRST = (
    "test_jobs.py",
    "test_tune.py",
    "test_cluster.py",
    "test_pipeline.py",
    "test_own_data.py",
    "test_sweeps.py",
    "test_ray_canaries.py",
    "test_finetune.py",
    "test_fault_tolerance.py",
)


# The fixtures that start Ray or a server (moto's S3, MLflow, PostgreSQL, a Ray head): a test that asks for one is
# slow, so `-m "not slow"` (a change's first feedback) starts neither. A test that starts them itself
# (a subprocess past Ray's start) carries its own mark.
STARTS_RAY_OR_A_SERVER = {
    "ray_runtime",
    "deterministic_run",
    "s3_endpoint",
    "s3_with_auth",
    "cluster",
    "preprocessing_cluster",
    "head",
    "tracking_server",
    "pretrained",
    "cli_run",
    "grid_sweep",
    "mlflow_ui",
    "server",
}


def ray_started() -> bool:
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


@pytest.fixture(autouse=True)
def unmarked_tests_start_no_ray(request):
    """A test not marked slow that started Ray here (Ray Data starts it on first use) fails, saying so."""
    before = ray_started()
    yield
    if not before and ray_started() and request.node.get_closest_marker("slow") is None:
        pytest.fail("this test started Ray: ask for the ray_runtime fixture (which marks it slow) or mark it slow")


COMMANDS: list = []  # the subprocess.Popen of each command a test started (test_preemption.start)


@pytest.fixture(autouse=True)
def no_command_outlives_its_test():
    """A command a failed test left running is stopped as a user stops one (SIGTERM, then SIGKILL after a minute):
    an orphan would hold its Ray runtime and its CPUs through the tests after it."""
    yield
    while COMMANDS:
        process = COMMANDS.pop()
        if process.poll() is None:
            process.terminate()
            try:
                process.communicate(timeout=60)  # its output read, so that a full pipe cannot hold it up
            except subprocess.TimeoutExpired:
                process.kill()
                process.communicate()


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marks
def pytest_collection_modifyitems(items: list) -> None:
    for item in items:
        if STARTS_RAY_OR_A_SERVER & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file's own order kept


def capture_warnings(caplog, monkeypatch, name: str) -> None:
    """Logger ``name``'s warnings into ``caplog``, whatever another test of this process left of logging (a
    root at ERROR, a library's fileConfig that disabled existing loggers)."""
    logger = logging.getLogger(name)
    below = [logging.getLogger(n) for n in list(logging.root.manager.loggerDict) if n.startswith(f"{name}.")]
    for each in [logger, *below]:  # a fileConfig disables the modules' loggers too, not only ``name``
        monkeypatch.setattr(each, "disabled", False)
    monkeypatch.setattr(logger, "handlers", [caplog.handler])
    caplog.set_level(logging.WARNING, logger=name)


def write_split(directory: Path, rows: int, files: int, seed: int, columns=("image", "label")) -> None:
    """``rows`` random 32x32 RGB JPEGs whose label (0-9) sets the mean brightness, so it is learnable."""
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    labels = rng.integers(0, 10, size=rows)
    images = [jpeg(np.clip(rng.normal(25 * y + 12, 20, (32, 32, 3)), 0, 255).astype(np.uint8)) for y in labels]
    table = pa.table({"image": pa.array(images, pa.binary()), "label": pa.array(labels, pa.int64())})
    table = table.select(list(columns))
    for i, part in enumerate(np.array_split(np.arange(rows), files)):
        pq.write_table(table.take(part), directory / f"part-{i:05d}.parquet")


@pytest.fixture(scope="session")
def data_root(tmp_path_factory) -> Path:
    """A PIPELINE_DATA_DIR holding cifar10/train (512 rows, 2 files) and cifar10/test (256 rows)."""
    root = tmp_path_factory.mktemp("data")
    write_split(root / "cifar10" / "train", 512, 2, seed=1)
    write_split(root / "cifar10" / "test", 256, 1, seed=2)
    return root


# ``python -m pipeline`` with what the machine gives it changed in its own process only: /proc unreadable to the
# liveness code (standing in for macOS and Windows), the wall clock skewed, the driver's heartbeat faster.
STAND_IN = """
import runpy, sys, time
no_proc, skew, beat_s = sys.argv[1:4]
if float(skew):  # before anything imports time.time; Ray pickles it by value: no reference to the builtin
    time.time = lambda: time.clock_gettime(time.CLOCK_REALTIME) + float(skew)
from pipeline.tracking import heartbeat, liveness
if no_proc == "1":
    liveness.PROC = "/nonexistent/proc"
if float(beat_s):
    heartbeat.BEAT_S = float(beat_s)
sys.argv[:] = ["pipeline", *sys.argv[4:]]
runpy.run_module("pipeline", run_name="__main__", alter_sys=True)
"""


def stand_in_command(args: list[str], *, no_proc: bool = False, skew_s: float = 0.0, beat_s: float = 0.0) -> list[str]:
    """The command line of ``python -m pipeline ARGS`` under :data:`STAND_IN`."""
    return [sys.executable, "-c", STAND_IN, "1" if no_proc else "0", str(skew_s), str(beat_s), *args]


def stepped_clock(monkeypatch, seconds: float) -> None:
    """This process's wall clock stepped by ``seconds``, as NTP or a resumed VM steps it: ``time.time`` and the boot
    time the kernel derives from it (which psutil adds to a process's start)."""
    wall, boot = time.time, psutil._psplatform.boot_time
    monkeypatch.setattr(time, "time", lambda: wall() + seconds)
    monkeypatch.setattr(psutil._psplatform, "boot_time", lambda: boot() + seconds)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, timeout_s: float = 60.0) -> None:
    """Block until a server listens on 127.0.0.1:port."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.3)


def descendants(pid: int) -> list[psutil.Process]:
    """Every live process below ``pid`` (Ray's raylet, GCS and workers for a local runtime)."""
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def alive(processes: list[psutil.Process]) -> dict[int, str]:
    """Those of ``processes`` still running, by pid, with their command lines; a zombie, or a pid that now
    names another process (psutil compares start times), counts as gone."""
    running = {}
    for process in processes:
        with contextlib.suppress(psutil.Error):
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                running[process.pid] = " ".join(process.cmdline())[:200]
    return running


@pytest.fixture(scope="module")
def s3_endpoint(data_root):
    """A moto S3 server with bucket ``data`` (the generated CIFAR-like splits) and bucket ``runs``."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    fs = pafs.S3FileSystem(endpoint_override=endpoint, allow_bucket_creation=True)
    fs.create_dir("data")
    fs.create_dir("runs")
    pafs.copy_files(str(data_root / "cifar10"), "data/cifar10", destination_filesystem=fs)
    yield endpoint
    server.stop()


compose_cfg = compose  # the typed config as the entry point hands it to a stage

# One worker and file order (augmentation is seeded per row and epoch): every run of this config computes
# the same numbers, from local files or S3, straight through or interrupted and resumed.
DETERMINISTIC = [
    "source.limit=null",
    "ingest.batch_size=16",
    "scaling.num_workers=1",
    "ingest.preserve_order=true",
    "train.epochs=3",
]


def in_process(tmp_path: Path, name: str, overrides: list[str]) -> tuple[dict, Path]:
    """Run a job inside pytest's process, on the shared Ray runtime, as a sweep's jobs run."""
    cfg = compose_cfg(["+experiment=smoke", f"paths.outputs={tmp_path / 'outputs'}", *overrides])
    run_dir = tmp_path / name
    return run(cfg, Job(str(run_dir), "smoke")).metrics, run_dir


@contextlib.contextmanager
def in_block_order(epoch: int = 0):
    """A job's epochs actor at ``epoch`` (:class:`pipeline.data.epochs.Epochs`) for datasets read in block order, as
    ingest.preserve_order=true runs (without it Ray Data hands blocks on as their tasks finish, which a busy machine
    reorders); the order option is put back and the actor ended afterwards. Claims about the order of rows need it."""
    import ray
    import ray.data

    from pipeline.data import epochs

    options = ray.data.DataContext.get_current().execution_options
    actor, kept = epochs.Epochs.remote(), options.preserve_order
    ray.get(actor.set_epoch.remote(epoch))
    options.preserve_order = True
    try:
        yield actor
    finally:
        options.preserve_order = kept
        ray.kill(actor)


def epoch_dataset(
    cfg, split, actor, *, seed: int | None = None, numbered: bool = False, built=None, task_mib=None, bare=False
):
    """``split`` read every epoch as a job reads it (:func:`pipeline.data.preprocess.read_epochs`): from storage, its
    streamed steps run, or from its cache (``built``: :func:`pipeline.data.preprocess.cached_split`'s), its per-epoch
    steps run; ``actor``: the epochs actor; ``numbered``: as the training split, each row numbered; ``task_mib``:
    ``ingest.read_task_mib``; ``bare``: as one node reads a split whose steps all run in the workers, whose shuffle
    buffers hold it whole (no step in Ray Data's tasks, each task's rows in their stored order)."""
    from pipeline.data import epochs, pieces, preprocess, steps

    groups = row_groups(split)
    columns = [split.layout.model_input, split.layout.label] if split.layout else ["image", "label"]
    if task_mib is not None:
        cfg = dataclasses.replace(cfg, ingest=dataclasses.replace(cfg.ingest, read_task_mib=task_mib))
    if built is not None:
        parts, run, first = epochs.cached_parts(built, groups, 3200), steps.cached_steps(split.steps)[1], []
    else:
        columns_read = [*(split.layout.inputs if split.layout else ["image"]), *columns[1:]]
        parts = epochs.stored_parts(groups, split.filesystem, columns_read)
        run, first = steps.streamed_steps(split.steps), steps.read_steps(split) if split.layout else []
    if bare:
        run, first = {}, []
    ds, _ = preprocess.read_epochs(
        parts,
        run,
        first,
        columns,
        cfg,
        name="train" if numbered else "valid",
        epoch_actor=actor,
        seed=seed,
        numbers=pieces.row_numbers(groups) if numbered else None,
        where={},
        mix=not bare,
    )
    return ds


def row_groups(split):
    """A split's row groups, with their label ranges, as a job plans its datasets from them."""
    from pipeline.data import pieces

    return pieces.row_groups(split.files, split.filesystem, None, split.layout.label if split.layout else "label")


@pytest.fixture(scope="session")
def ray_runtime():
    """One local Ray runtime for the in-process tests, as a sweep would share it."""
    import ray

    from pipeline.runtime.cluster import start_ray

    start_ray(address=None, num_cpus=2)
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def deterministic_run(ray_runtime, data_root, tmp_path_factory) -> dict:
    """The last epoch's metrics of one uninterrupted run of DETERMINISTIC on local files: what a run
    that was interrupted and resumed, and one that read S3, must reproduce."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PIPELINE_DATA_DIR", str(data_root))
        metrics, _ = in_process(tmp_path_factory.mktemp("deterministic"), "run", DETERMINISTIC)
    return metrics


LEDGER_ROWS, WIDE = 1000, 2048  # the ledger data's training rows, and the features of its wide column


@pytest.fixture(scope="module")
def ledger_data(tmp_path_factory) -> Path:
    """A table whose first feature is each row's number (``row``), in 4 files of row groups of 50 rows; ``wide`` holds
    the same three features in a list of ``WIDE`` (the rest zeros), so that a batch of 20 rows makes a block of Ray
    Data's larger than Ray keeps in its owner's memory (100 KB): in the object store of the node that read it."""
    root = tmp_path_factory.mktemp("ledger")
    rng = np.random.default_rng(0)
    for split, rows in (("train", LEDGER_ROWS), ("valid", 100)):
        x = rng.normal(size=(rows, 2))
        target = (x[:, 0] > 0).astype(np.int64)
        wide = np.zeros((rows, WIDE), dtype=np.float32)
        wide[:, 0], wide[:, 1:3] = np.arange(rows), x
        table = pa.table(
            {
                "row": np.arange(rows, dtype=np.float64),
                "x0": x[:, 0],
                "x1": x[:, 1],
                "target": target,
                "wide": pa.FixedSizeListArray.from_arrays(wide.reshape(-1), WIDE),
            }
        )
        (root / split).mkdir()
        for part in range(4):
            pq.write_table(
                table.slice(part * rows // 4, rows // 4), root / split / f"{part}.parquet", row_group_size=50
            )
    return root
