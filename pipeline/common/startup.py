"""Where a run's first minute goes: the wall-clock time each start-up phase ended, on the driver (:class:`Startup`,
one per job) and in rank 0's worker (sent with its first step), shown from the command's start on the console and
logged with the run as ``system/startup_<phase>_s`` (:meth:`pipeline.tracking.epochs.EpochLog.log_startup`): on
MLflow's System metrics tab, beside the machine's, so the Model metrics tab opens on training's charts."""

from __future__ import annotations

import time

# Each phase, in the order a run reaches them, and what its time marks the end of.
PHASES = {
    "sources": "the config's values and targets checked, and the splits' files found and their footers read",
    "ray_up": "Ray started or joined (it starts while the job's modules import), the other inputs checked, and the "
    "MLflow store open",
    "data": "each split planned, and its cache's tasks submitted (they run on while training starts)",
    "run": "the MLflow run created, with its parameters and the splits' records",
    "fit": "Ray Train's TorchTrainer asked to fit",
    "worker": "rank 0's training function started, in its process with torch imported",
    "model": "rank 0's model built on its device (and restored, on a resume)",
    "first_batch": "rank 0's first batch on its device",
    "first_step": "rank 0's first optimizer step taken (startup_s)",
}


def metric(phase: str) -> str:
    """The MLflow metric of ``phase``'s end."""
    return f"system/startup_{phase}_s"


class Startup:
    """The phases of one job's start-up, as wall-clock times (``time.time()``, comparable with the workers')."""

    def __init__(self) -> None:
        self.at: dict[str, float] = {}

    def mark(self, phase: str, at: float | None = None) -> None:
        """``phase`` (a key of :data:`PHASES`) ended now, or at ``at``; the first time counts."""
        if phase not in PHASES:
            raise KeyError(f"unknown start-up phase {phase!r}")
        self.at.setdefault(phase, time.time() if at is None else at)

    def seconds(self, started_at: float) -> dict[str, float]:
        """Each phase reached, in :data:`PHASES`'s order, as seconds from ``started_at``."""
        return {phase: self.at[phase] - started_at for phase in PHASES if phase in self.at}

    def line(self, started_at: float) -> str:
        seconds = self.seconds(started_at).items()
        return "start-up: " + ", ".join(f"{phase.replace('_', ' ')} {s:.1f} s" for phase, s in seconds)
