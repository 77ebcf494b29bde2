"""What a whole command costs in CPU-seconds, every process it starts counted (Ray's daemons, actors and task
workers, a DataLoader's workers): the command runs in a cgroup of its own where this machine lets us make one (cgroup
v1 ``cpuacct`` or v2 ``cpu.stat``, as root), and every process of it is sampled with psutil meanwhile, so a stretch of
the run (its warm epochs) can be costed process by process. Without a cgroup the samples cover the command's
descendants alone, and the total is their sum (a process that lives less than a sample's period is missed).
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from pathlib import Path

import psutil

PERIOD_S = 0.25
V1, V2 = Path("/sys/fs/cgroup/cpuacct"), Path("/sys/fs/cgroup/unified")
_names = itertools.count()


class Meter:
    """CPU-seconds of one command: start it with ``preexec_fn=meter.enter`` (the child joins the cgroup before it
    runs anything), call :meth:`watch` with its pid, :meth:`stop` once it exited."""

    def __init__(self) -> None:
        self.group = _cgroup()
        self.samples: list[tuple[float, dict[int, float]]] = []  # (time.time(), {pid: CPU-seconds so far})
        self.names: dict[int, str] = {}  # pid -> its command line's first words, at last sight (Ray retitles its)
        self.root: int | None = None
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.sample, daemon=True)
        self.total_s: float | None = None

    def enter(self) -> None:
        """In the child, before it runs the command: join the cgroup."""
        if self.group is not None:
            (self.group / "cgroup.procs").write_text(str(os.getpid()))

    def watch(self, pid: int) -> None:
        self.root = pid
        self.thread.start()

    def processes(self) -> list[psutil.Process]:
        if self.group is not None:
            pids = [int(p) for p in (self.group / "cgroup.procs").read_text().split()]
            return [psutil.Process(pid) for pid in pids if psutil.pid_exists(pid)]
        root = psutil.Process(self.root)
        return [root, *root.children(recursive=True)]

    def sample(self) -> None:
        while not self.done.is_set():
            seen = {}
            try:
                processes = self.processes()
            except (psutil.Error, OSError):
                processes = []
            for process in processes:
                try:
                    with process.oneshot():
                        times = process.cpu_times()
                        seen[process.pid] = times.user + times.system
                        self.names[process.pid] = " ".join(process.cmdline()[:3])[:120] or process.name()
                except psutil.Error:
                    continue
            self.samples.append((time.time(), seen))
            self.done.wait(PERIOD_S)

    def stop(self) -> None:
        """The command exited: the last sample, the cgroup's total, the cgroup removed."""
        self.done.set()
        self.thread.join()
        if self.group is not None:
            self.total_s = _usage(self.group)
            for _ in range(40):  # Ray's daemons may take a moment to leave
                try:
                    self.group.rmdir()
                    break
                except OSError:
                    time.sleep(0.25)
        else:
            self.total_s = sum(self.last().values())

    def last(self) -> dict[int, float]:
        """Each process's CPU-seconds at its last sample."""
        out: dict[int, float] = {}
        for _, seen in self.samples:
            out.update(seen)
        return out

    def between(self, start: float, end: float) -> dict[int, float]:
        """Each process's CPU-seconds from wall-clock ``start`` to ``end`` (``time.time()``), from the samples
        nearest them (a process not yet seen at ``start`` counts from zero)."""
        before = self.at(start)
        return {pid: cpu - before.get(pid, 0.0) for pid, cpu in self.at(end).items() if cpu - before.get(pid, 0.0) > 0}

    def at(self, moment: float) -> dict[int, float]:
        out: dict[int, float] = {}
        for when, seen in self.samples:
            if when > moment:
                break
            out.update(seen)
        return out

    def figures(self) -> dict:
        """What a report keeps: the total, and each process's CPU-seconds and name (the busiest 40)."""
        busiest = sorted(self.last().items(), key=lambda item: -item[1])[:40]
        return {
            "cpu_s": round(self.total_s, 1),
            "counted_by": "cgroup" if self.group is not None else "psutil",
            "processes": [[pid, self.names.get(pid, "?"), round(cpu, 2)] for pid, cpu in busiest],
        }


def _cgroup() -> Path | None:
    """A fresh cgroup for one command (None where this machine does not let us make one)."""
    name = f"bench-{os.getpid()}-{next(_names)}"
    for root in (V1, V2):
        try:
            group = root / name
            group.mkdir()
            if _usage(group) is not None:
                return group
            group.rmdir()
        except OSError:
            continue
    return None


def _usage(group: Path) -> float | None:
    """The cgroup's CPU-seconds so far (v1 ``cpuacct.usage`` in ns, v2 ``cpu.stat`` usage_usec)."""
    if (group / "cpuacct.usage").exists():
        return int((group / "cpuacct.usage").read_text()) / 1e9
    if (group / "cpu.stat").exists():
        stats = dict(line.split() for line in (group / "cpu.stat").read_text().splitlines())
        return int(stats["usage_usec"]) / 1e6
    return None
