"""Whether a run's driver lives, judged only on what can be trusted (on the driver and on any command that opens the
store). Two witnesses, never a comparison of two machines' clocks:

- on the driver's own machine, its process: the run's :data:`DRIVER_TAG` names the boot and pid namespace, the pid
  and the process's start in clock ticks since boot (``/proc/PID/stat``), which a stepped wall clock leaves as it
  is, and which two hosts of one name never share;
- anywhere, on a tracking server, its heartbeat: each beat (:mod:`pipeline.tracking.heartbeat`) stamps the
  server's own time (its answers' ``Date`` header), and silence is that stamp against the server's time now.

Where neither witness answers (no ``/proc``: macOS, Windows; a database URI, whose clock is not asked; no beat),
a command says so once and leaves the run as it is: a live run is never ended.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from email.utils import parsedate_to_datetime

import requests

log = logging.getLogger(__name__)

PROC = "/proc"  # Linux's process table; where it cannot be read, no process is judged from here
DRIVER_TAG = "pipeline.driver"  # HOST#MACHINE:PID:START of the process that holds the run RUNNING and ends it
HEARTBEAT_TAG = "pipeline.heartbeat"  # "<unix seconds> server": the tracking server's time at the driver's last beat
STALE_S = 900.0  # a run whose driver has not beaten for this long, by the server's clock, is taken for gone
ORPHAN = "driver gone"  # how the error of a run ended for its driver starts: the only end its driver takes back
SERVER_TIMEOUT_S = 5.0
UNKNOWN = "?"


def this_machine() -> str | None:
    """Where a pid names one process: this boot (pids are reused after a reboot) and pid namespace (containers on
    one host each have their own); None where ``/proc`` cannot be read."""
    try:
        with open(f"{PROC}/sys/kernel/random/boot_id") as file:
            boot = file.read().strip()
        namespace = os.stat(f"{PROC}/self/ns/pid").st_ino
    except OSError:
        return None
    return f"{boot}/{namespace}"


def started(pid: int) -> str | None:
    """When process ``pid`` started, in clock ticks since boot (``/proc/PID/stat``'s 22nd field), None if no such
    process: unlike a wall-clock start time it holds when the clock is stepped (NTP, a resumed VM)."""
    try:
        with open(f"{PROC}/{pid}/stat") as file:
            return file.read().rsplit(")", 1)[1].split()[19]
    except FileNotFoundError:
        return None


def this_driver() -> str:
    """This process, as :data:`DRIVER_TAG` names it."""
    machine = this_machine()
    start = started(os.getpid()) if machine else None
    return f"{socket.gethostname()}#{machine or UNKNOWN}:{os.getpid()}:{start or UNKNOWN}"


@dataclass(frozen=True)
class Driver:
    """The process a run's :data:`DRIVER_TAG` names."""

    host: str
    machine: str
    pid: int
    start: str

    @classmethod
    def of(cls, tags: dict[str, str]) -> Driver | None:
        try:
            where, pid, start = tags[DRIVER_TAG].rsplit(":", 2)
            host, _, machine = where.partition("#")
            return cls(host, machine or UNKNOWN, int(pid), start)
        except (KeyError, ValueError):  # none, or not one of ours: no driver to judge
            return None

    def __str__(self) -> str:
        return f"pid {self.pid} on {self.host}"

    def here(self) -> bool:
        """Whether it ran on this machine, this boot: its pid can be looked up here."""
        return self.machine != UNKNOWN and self.machine == this_machine()

    def gone(self) -> bool:
        """Whether its process ended (one that cannot be read counts as alive). Only for a driver :meth:`here`."""
        try:
            return started(self.pid) != self.start  # none, or a reused pid: another process
        except OSError:
            return False


def health(uri: str) -> requests.Response:
    """The tracking server's answer to ``GET /health``, within :data:`SERVER_TIMEOUT_S` (MLflow's own client retries
    an unreachable server for minutes); raises ``requests.RequestException`` when none comes."""
    return requests.get(f"{uri.rstrip('/')}/health", timeout=SERVER_TIMEOUT_S)


def server_time(uri: str) -> float | None:
    """The tracking server's clock now (its answer's ``Date``; any answer carries one), or None: no server
    (a local or database store), none answering, or no date."""
    if not uri.startswith(("http://", "https://")):
        return None
    try:
        date = health(uri).headers.get("Date")
        return None if date is None else parsedate_to_datetime(date).timestamp()
    except (requests.RequestException, TypeError, ValueError):
        return None


def beat_value(at: float) -> str:
    """What a beat stamps: the server's time at the beat."""
    return f"{at:.0f} server"


def last_beat(tags: dict[str, str]) -> float | None:
    """The server's time at the driver's last beat, None without one (or one an older version stamped with its own
    clock)."""
    at, _, clock = tags.get(HEARTBEAT_TAG, "").partition(" ")
    try:
        return float(at) if clock == "server" else None
    except ValueError:
        return None


@dataclass(frozen=True)
class Verdict:
    """Whether a RUNNING run's driver is gone: True, False (it lives, or beat within :data:`STALE_S`), or None
    (nothing here can tell); ``why`` says what was seen, ``silent_s`` the server's seconds since its last beat."""

    gone: bool | None
    why: str
    driver: Driver | None = None
    silent_s: float | None = None


def judge(tags: dict[str, str], now: float | None) -> Verdict:
    """The verdict on a RUNNING run's driver from its tags and the server's time ``now`` (:func:`server_time`)."""
    driver = Driver.of(tags)
    if driver is not None and driver.here():
        if driver.gone():
            return Verdict(True, f"its driver ({driver}) ended", driver)
        return Verdict(False, f"its driver, {driver}, is alive", driver)
    beat = last_beat(tags)
    who = f"its driver ({driver or 'unknown'})"
    if beat is None or now is None:
        reason = cannot_tell(driver, beat is None, now is None)
        return Verdict(None, f"{who}: {reason}", driver)
    silent = now - beat
    if silent >= STALE_S:
        return Verdict(True, f"{who} has not beaten for {silent / 60:.0f} min (by the tracking server's clock)", driver)
    ago = f"{max(silent, 0):.0f} s ago"
    return Verdict(False, f"{who} beat {ago} (by the tracking server's clock)", driver, silent)


def cannot_tell(driver: Driver | None, no_beat: bool, no_clock: bool) -> str:
    """Why this machine cannot judge a driver."""
    if driver is not None and driver.machine != UNKNOWN and this_machine() is None:
        local = "this machine cannot read its process table (no /proc: macOS, Windows)"
    elif driver is not None and driver.machine == UNKNOWN:
        local = "it ran where processes cannot be looked up (no /proc: macOS, Windows)"
    else:
        local = "it ran on another machine"
    if no_beat:
        return f"{local}, and it leaves no heartbeat (it beats on a tracking server only)"
    if no_clock:
        return f"{local}, and this store has no server whose clock could time its heartbeat"
    return local


_said = False  # whether this process said what it could not judge (the store is opened by every job of a sweep)


def say_undecided(undecided: list) -> None:
    """Once per process: the runs RUNNING whose driver nothing here can judge, left as they are."""
    global _said
    if undecided and not _said:
        _said = True
        run, verdict = undecided[0]
        log.info(
            "%d MLflow run(s) RUNNING whose driver this command cannot judge are left as they are, e.g. %r (%s): "
            "%s. A run whose driver is gone stays RUNNING until it is ended in MLflow (a resume of it says how).",
            len(undecided),
            run.info.run_name,
            run.info.run_id,
            verdict.why,
        )
