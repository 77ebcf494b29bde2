"""``train.profile``: where rank 0's training steps spend their time (runs in rank 0's worker). torch.profiler over a
few steps of one epoch writes its trace and a table of the operators, and every epoch Ray Data's per-operator stats
of the training split are written beside them, into the run's storage under ``profile/``; the driver copies that
folder to the run's MLflow artifacts after each epoch (:meth:`pipeline.tracking.tracker.Tracker.log_profile`).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Iterator

import torch
from torch.profiler import ProfilerActivity

from pipeline.config import ProfileConfig
from pipeline.runtime.filesystems import RunStorage

PROFILE_DIR = "profile"  # in the run's storage, and in its MLflow artifacts


def write(storage: RunStorage, name: str, data: bytes) -> None:
    """``profile/<name>`` in the run's storage."""
    directory = f"{storage.path}/{storage.name}/{PROFILE_DIR}"
    storage.filesystem.create_dir(directory)
    with storage.filesystem.open_output_stream(f"{directory}/{name}") as out:
        out.write(data)


class StepProfile:
    """torch.profiler over the steps of the configured epoch (CPU, and CUDA on a GPU), its schedule skipping the
    first ``wait`` steps and discarding ``warmup``, a step per batch. Its files, once the
    ``active`` steps are recorded: ``trace_epoch<E>.json`` (Chrome's trace format: Perfetto and TensorBoard open it)
    and ``operators_epoch<E>.txt`` (the top operators by their own time)."""

    def __init__(self, settings: ProfileConfig, device: torch.device, storage: RunStorage, epoch: int):
        self.settings, self.storage, self.epoch, self.saved = settings, storage, epoch, False
        self.cuda = device.type == "cuda"
        activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if self.cuda else [])]
        schedule = torch.profiler.schedule(wait=settings.wait, warmup=settings.warmup, active=settings.active, repeat=1)
        self.profiler = torch.profiler.profile(activities=activities, schedule=schedule, on_trace_ready=self.save)

    def around(self, batches: Iterable[dict]) -> Iterator[dict]:
        """``batches``, the profiler on from the first one asked for until the last is trained on (or the epoch is
        left: a stop), a profiler step after each: the time waiting for a batch is in the trace too."""
        taken = 0
        with self.profiler:
            for taken, batch in enumerate(batches, start=1):  # noqa: B007 (the count is read after the loop)
                yield batch
                self.profiler.step()
        if not self.saved:  # the schedule never reached its recorded steps
            note = f"epoch {self.epoch + 1} had {taken} steps here, too few for train.profile's wait + warmup + 1"
            write(self.storage, f"operators_epoch{self.epoch + 1}.txt", f"{note}\n".encode())

    def save(self, profiler: torch.profiler.profile) -> None:
        with tempfile.TemporaryDirectory() as local:  # the profiler writes a local file only
            trace = os.path.join(local, "trace.json")
            profiler.export_chrome_trace(trace)
            with open(trace, "rb") as written:
                write(self.storage, f"trace_epoch{self.epoch + 1}.json", written.read())
        sort = "self_cuda_time_total" if self.cuda else "self_cpu_time_total"
        table = profiler.key_averages().table(sort_by=sort, row_limit=self.settings.row_limit)
        first = self.settings.wait + self.settings.warmup + 1
        steps = f"epoch {self.epoch + 1}, steps {first}-{first + self.settings.active - 1}"
        write(self.storage, f"operators_epoch{self.epoch + 1}.txt", f"{steps}\n{table}\n".encode())
        self.saved = True
