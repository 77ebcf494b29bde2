"""Ray's own start-up floor: the least time from command to first batch for a Ray Train job fed by Ray Data on
this machine. A fresh process imports what such a job needs (Ray Train, Ray Data, torch), starts Ray as the
pipeline does (``pipeline.runtime.cluster``), and its workers take the first batch of a tiny range dataset: no model,
no MLflow, no Hydra, no parquet. The clock starts with the process, as the pipeline's ``startup_s`` does. The
job has the shape of the one it is compared with: its workers and their CPUs, and as many datasets (Ray
starts a split coordinator for each). ``--workers 0`` is Ray Train's local mode: the training function runs in
this process, with no controller and no worker group (nor their restarts). ``bench/startup.py`` runs it beside
the pipeline.

    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 python bench/floor.py [--workers N] [--cpus-per-worker X] [--datasets K]
"""

from __future__ import annotations

import time

STARTED_AT = time.time()  # before any import: the command's start

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import tempfile  # noqa: E402

import ray.data  # noqa: E402
import ray.train  # noqa: E402
from ray.train.torch import TorchTrainer  # noqa: E402

from pipeline.runtime.cluster import start_ray  # noqa: E402


def first_batch(config: dict) -> None:
    next(iter(ray.train.get_dataset_shard("train").iter_torch_batches(batch_size=128)))
    if ray.train.get_context().get_world_rank() == 0:  # local mode: rank 0 too
        with open(config["out"], "w") as out:
            out.write(str(time.time()))


def floor(workers: int, cpus_per_worker: float, datasets: int) -> float:
    """Seconds from this process's start to the first batch of rank 0."""
    start_ray(None, None)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "first_batch")
        TorchTrainer(
            first_batch,
            train_loop_config={"out": out},
            scaling_config=ray.train.ScalingConfig(
                num_workers=workers, resources_per_worker={"CPU": cpus_per_worker} if workers else None
            ),
            datasets={name: ray.data.range(10_000) for name in ["train", "valid", "test"][:datasets]},
            run_config=ray.train.RunConfig(storage_path=tmp, name="floor"),
        ).fit()
        with open(out) as file:
            return round(float(file.read()) - STARTED_AT, 1)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Ray Train + Ray Data's start-up floor on this machine.")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--cpus-per-worker", type=float, default=1.0)
    parser.add_argument("--datasets", type=int, default=1, choices=[1, 2, 3])
    arguments = parser.parse_args()
    seconds = floor(arguments.workers, arguments.cpus_per_worker, arguments.datasets)
    print(json.dumps({"startup_s": seconds}), flush=True)
    # Local mode ran the training function here: Ray Data's prefetch thread of its abandoned iterator outlived
    # ray.shutdown() at exit and Ray's core ended the process non-zero ("The core worker has already been shutdown")
    os._exit(0)
