"""Ray's own start-up floor: the least time from command to first batch for a Ray Train job fed by
Ray Data on this machine. A fresh process starts Ray as the pipeline does (``pipeline.cluster``),
then one worker takes the first batch of a tiny range dataset: no model, no MLflow, no Hydra, no
parquet. ``bench/train.py`` runs it beside the pipeline, so the pipeline's start-up reads as a ratio
to what Ray alone needs.

    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 python bench/floor.py   # prints {"startup_s": ...}
"""

from __future__ import annotations

import json
import os
import tempfile
import time

import ray.data
import ray.train
from ray.train.torch import TorchTrainer

import pipeline  # first: starts the clock (pipeline.STARTED_AT) where `python -m pipeline` starts it
from pipeline.cluster import start_ray


def first_batch(config: dict) -> None:
    next(iter(ray.train.get_dataset_shard("train").iter_torch_batches(batch_size=128)))
    with open(config["out"], "w") as out:
        out.write(str(time.time()))


def main() -> None:
    start_ray(None, None)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "first_batch")
        TorchTrainer(
            first_batch,
            train_loop_config={"out": out},
            scaling_config=ray.train.ScalingConfig(num_workers=1, resources_per_worker={"CPU": 1}),
            datasets={"train": ray.data.range(10_000)},
            run_config=ray.train.RunConfig(storage_path=tmp, name="floor"),
        ).fit()
        with open(out) as file:
            reached = float(file.read())
    print(json.dumps({"startup_s": round(reached - pipeline.STARTED_AT, 1)}))


if __name__ == "__main__":
    main()
