"""Runs on the driver while a job trains: notices that Ray itself is gone (the head node's GCS, or a local
runtime's raylet, killed by an OOM killer or lost with its machine) and ends the command at once, the run
recorded and no process of the local Ray session left behind.

Ray 2.60: a driver whose GCS is gone keeps retrying it for ``gcs_rpc_server_reconnect_timeout_s`` (60 s),
then exits from Ray's C++ core without running Python's cleanup: the MLflow run stayed RUNNING forever and
the console's last line was Ray's ``Failed to connect to GCS``. Every Ray call the driver could make to end
the run cleanly waits on the same GCS, so this thread records the end itself (``on_lost``), ends the local
session's processes it knows and leaves with exit status 1.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import threading
from collections.abc import Callable, Iterator

import psutil
import ray

from pipeline.common import signals

log = logging.getLogger(__name__)

POLL_S = 2.0  # between two probes of the GCS (and a local raylet)
LOST_AFTER = 3  # failed probes in a row: a GCS restarting under load answers within that


@contextlib.contextmanager
def watched(on_lost: Callable[[str], None]) -> Iterator[None]:
    """While the block runs, probe Ray every ``POLL_S``; once it is gone (``LOST_AFTER`` probes in a row), call
    ``on_lost`` with what was lost, end the processes this one started (a local runtime's) and exit with 1."""
    address = ray.get_runtime_context().gcs_address
    own = Session()
    stop = threading.Event()

    def watch() -> None:
        failures = 0
        while not stop.wait(POLL_S):
            gone = own.raylet_gone()
            failures = 0 if answers(address) else failures + 1
            if signals.stop_requested():  # Ray's processes go with a stopping command (a shutdown SIGTERMs them all):
                return  # the stop is recorded, KILLED, not Ray lost, FAILED (a race the lifeline won under load)
            if gone:
                lost(f"this machine's raylet (pid {own.raylet.pid}) is gone", on_lost, own)
            if failures >= LOST_AFTER:
                lost(f"its GCS at {address} stopped answering", on_lost, own)
            own.refresh()

    thread = threading.Thread(target=watch, name="ray-lifeline", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def answers(address: str) -> bool:
    """Whether something accepts connections at the GCS's ``HOST:PORT``."""
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=1.0).close()
    except OSError:
        return False
    return True


class Session:
    """This process's descendants (a local runtime's raylet, GCS and workers; none on a cluster it joined),
    kept up to date while Ray lives: once the raylet is gone its workers are no longer this process's."""

    def __init__(self):
        self.processes: dict[int, psutil.Process] = {}
        self.raylet: psutil.Process | None = None  # a local runtime's
        self.refresh()

    def refresh(self) -> None:
        for process in psutil.Process().children(recursive=True):
            self.processes.setdefault(process.pid, process)
            with contextlib.suppress(psutil.Error):
                if self.raylet is None and "raylet" in process.name():
                    self.raylet = process

    def raylet_gone(self) -> bool:
        """Whether a local raylet has ended: killed, it stays this process's zombie, which psutil counts as running."""
        if self.raylet is None:
            return False
        try:
            return self.raylet.status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    def end(self) -> None:
        for process in self.processes.values():
            with contextlib.suppress(psutil.Error):
                if process.is_running():  # still that process (psutil tells a reused pid apart)
                    process.kill()


def lost(what: str, on_lost: Callable[[str], None], session: Session) -> None:
    """Record the end (``on_lost``), end what is left of the local session, and leave."""
    try:
        on_lost(what)
    finally:
        session.end()
        for handler in logging.getLogger().handlers:
            handler.flush()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # the main thread waits on Ray, which will not answer
