"""Real servers for the cluster route's tests (tests/test_jobs.py), on 127.0.0.1, each ended by pid:
PostgreSQL (Debian's, run as the ``postgres`` user when the tests run as root), an MLflow tracking server
on it with artifacts proxied to S3, and a ``ray start`` head node with Ray's default token authentication,
its own ports, temp dir and home (where ``ray start`` writes the token).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import requests
from conftest import descendants, free_port, wait_for_port

BIN = Path(sys.executable).parent  # this environment's ray and mlflow commands


def end(processes: list[psutil.Process], grace_s: float = 5.0) -> None:
    """SIGTERM each of ``processes``, then SIGKILL those still running after ``grace_s``."""
    for process in processes:
        with contextlib.suppress(psutil.Error):
            process.terminate()
    _, running = psutil.wait_procs(processes, timeout=grace_s)
    for process in running:
        with contextlib.suppress(psutil.Error):
            process.kill()
    psutil.wait_procs(running, timeout=grace_s)


def with_descendants(processes: list[psutil.Process]) -> list[psutil.Process]:
    return [*processes, *(child for process in processes for child in descendants(process.pid))]


def postgres_available() -> str | None:
    """Why PostgreSQL's tests cannot run here, or None."""
    if shutil.which("initdb") is None or shutil.which("postgres") is None:
        return "PostgreSQL is not installed (Debian: apt-get install postgresql)"
    if os.geteuid() == 0 and shutil.which("runuser") is None:
        return "running as root needs runuser to start PostgreSQL as the postgres user"
    return None


def as_postgres(command: list[str]) -> list[str]:
    """PostgreSQL refuses to run as root: as root, run ``command`` as the ``postgres`` user."""
    return ["runuser", "-u", "postgres", "--", *command] if os.geteuid() == 0 else command


@contextlib.contextmanager
def postgres():
    """A PostgreSQL server on a free loopback port with an empty database ``mlflow``; yields its
    SQLAlchemy URI (psycopg 3)."""
    data = Path(tempfile.mkdtemp(prefix="pg", dir="/tmp"))  # short: the socket's path has a length limit
    if os.geteuid() == 0:
        shutil.chown(data, "postgres", "postgres")
    port = free_port()
    subprocess.run(
        as_postgres(["initdb", "-D", str(data / "db"), "-A", "trust", "-U", "postgres"]),
        check=True,
        capture_output=True,
    )
    server = subprocess.Popen(
        as_postgres(["postgres", "-D", str(data / "db"), "-h", "127.0.0.1", "-p", str(port), "-k", str(data)]),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for_port(port)
        for _ in range(50):  # the port opens before the server accepts connections
            created = subprocess.run(
                ["createdb", "-h", "127.0.0.1", "-p", str(port), "-U", "postgres", "mlflow"], capture_output=True
            )
            if created.returncode == 0:
                break
            time.sleep(0.2)
        else:
            raise RuntimeError(f"createdb failed: {created.stderr.decode()}")
        yield f"postgresql+psycopg://postgres@127.0.0.1:{port}/mlflow"
    finally:
        end(with_descendants([psutil.Process(server.pid)]))
        shutil.rmtree(data, ignore_errors=True)


# MLflow 3.17's server starts a job runner with four Huey consumers (its GenAI jobs, which nothing here
# uses): about 20 more processes and 25 - 60 more CPU-seconds a server start (docs/cluster.md).
NO_SERVER_JOBS = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}


@contextlib.contextmanager
def mlflow_server(backend_uri: str, artifacts: str, s3_endpoint: str | None = None, port: int | None = None):
    """``mlflow server`` on a loopback port (``port``, else a free one), runs in ``backend_uri``, artifacts
    proxied to ``artifacts`` (a directory, or an s3:// URI on the S3 server at ``s3_endpoint``): clients
    upload and download through the server and need no S3 credentials. Yields its URL."""
    port = port or free_port()
    env = {**os.environ, **NO_SERVER_JOBS, **({"MLFLOW_S3_ENDPOINT_URL": s3_endpoint} if s3_endpoint else {})}
    server = subprocess.Popen(
        [
            str(BIN / "mlflow"),
            "server",
            "--backend-store-uri",
            backend_uri,
            "--artifacts-destination",
            artifacts,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:  # the port opens before the database's tables exist
            with contextlib.suppress(requests.RequestException):
                if requests.get(f"{url}/health", timeout=2).ok:
                    break
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"mlflow server did not start (exit {server.poll()})")
            time.sleep(0.5)
        yield url
    finally:
        end(with_descendants([psutil.Process(server.pid)]))


@dataclass
class RayHead:
    """A ``ray start --head`` node: its GCS address, the Jobs API's URL, and the environment a client on
    this machine uses (the head's home, holding the token ``ray start`` wrote)."""

    address: str
    dashboard: str
    env: dict[str, str]
    temp_dir: Path
    processes: list[psutil.Process] = field(default_factory=list)

    def session_processes(self) -> list[psutil.Process]:
        """The head's processes (found by its temp dir) and everything they started."""
        mine = [p for p in psutil.process_iter() if str(self.temp_dir) in " ".join(_cmdline(p))]
        return with_descendants([*self.processes, *mine])


def _cmdline(process: psutil.Process) -> list[str]:
    try:
        return process.cmdline()
    except psutil.Error:
        return []


@contextlib.contextmanager
def ray_head(num_cpus: int = 4):
    """A head node with Ray's defaults (token authentication on, as ``ray start`` turns it on wherever a
    token exists) and every fixed default port moved to a free one, so it runs beside the tests' other
    runtimes; ended by pid, leaving no process behind."""
    temp = Path(tempfile.mkdtemp(prefix="rh", dir="/tmp"))  # short: Ray's socket paths have a length limit
    home = temp / "home"
    home.mkdir()
    # RAY_TMPDIR: this head's processes look up "the cluster" (Ray Train's placement-group cleaner asks the
    # state API of the one in $RAY_TMPDIR/ray/ray_current_cluster) in the temp dir it writes, not /tmp/ray
    env = {
        **os.environ,
        "HOME": str(home),
        "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
        "RAY_TMPDIR": str(temp),
    }
    for variable in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        env.pop(variable, None)
    # the token a local ray.init() leaves in ~/.ray/auth_token: with it, ray start turns authentication on
    subprocess.run([str(BIN / "ray"), "get-auth-token", "--generate"], env=env, check=True, capture_output=True)
    port, dashboard = free_port(), free_port()
    subprocess.run(
        [
            str(BIN / "ray"),
            "start",
            "--head",
            "--node-ip-address=127.0.0.1",
            f"--port={port}",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dashboard}",
            f"--ray-client-server-port={free_port()}",
            f"--dashboard-agent-listen-port={free_port()}",
            f"--num-cpus={num_cpus}",
            f"--temp-dir={temp / 'ray'}",
            "--disable-usage-stats",
        ],
        env=env,
        check=True,
        capture_output=True,
    )
    head = RayHead(f"127.0.0.1:{port}", f"http://127.0.0.1:{dashboard}", env, temp)
    head.processes = head.session_processes()
    try:
        wait_for_port(dashboard)
        deadline = time.monotonic() + 120
        while True:  # the Jobs API answers "No available agent" until the head's agent has registered
            job = subprocess.run(
                [str(BIN / "ray"), "job", "submit", "--", "true"],
                env={**env, "RAY_AUTH_MODE": "token", "RAY_ADDRESS": head.dashboard},
                capture_output=True,
                text=True,
            )
            if job.returncode == 0 or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert job.returncode == 0, job.stderr[-2000:]
        yield head
    finally:
        end(head.session_processes())
        shutil.rmtree(temp, ignore_errors=True)
