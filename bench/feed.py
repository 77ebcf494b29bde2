"""The feed alone: batches handed to one training worker whose model reads nothing of them (``bench/probe.py``'s
``Bias``), the pipeline with its defaults against a DataLoader over the same rows decoded once and held in memory with
the same steps (``bench/plain.py --data decoded --transforms pipeline``: a worker per core, persistent), side by side,
over seeds, on cached sets:

- ``cifar``: CIFAR-10's 50,000 training rows, crop and flip every epoch;
- ``photos``: 6,400 photos at their 256-pixel working size, the random-resized crop to 224 (and its flip) every epoch.

With the defaults on one node the worker reads the cache itself and runs those steps on its device (with no GPU,
in its feed threads), so the CPU-seconds of every process but the training worker are what the run's machinery
costs once the per-epoch work is off the other processes: on a GPU, what the CPUs pay. ``photos-tasks`` is the
photos with the crop kept in Ray Data's CPU tasks (``transforms.train.crop.on_device=false``), for the contrast.

Each side is a command of its own, its CPU-seconds counted over every process it starts (``bench/cpu.py``).

    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 PIPELINE_DATA_DIR=../shared/data \\
        python bench/feed.py [--sets cifar,photos,photos-tasks] [--seeds 0,1,2] [OVERRIDES...]

About 3 minutes per seed and set on 2 cores. Prints a table per set and writes outputs/bench/feed.json.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from ingest import ONE_WORKER, PHOTO_DATA, SAME_STEPS_DECODED, side_by_side
from report import comparison, comparisons_table, data_dir, write

EPOCHS = 4  # the first fills the cache; the other three are the warm epochs a long run lives on
COMMON = ["model=bias", f"train.epochs={EPOCHS}", *ONE_WORKER]  # bench/conf/model/bias.yaml: a bias per class
SETS = {
    "cifar": [],
    "photos": PHOTO_DATA,
    "photos-tasks": [*PHOTO_DATA, "transforms.train.crop.on_device=false"],
}


def main(sets: list[str], seeds: list[int], extra: list[str]) -> None:
    data_dir()
    runs: dict[str, list[dict]] = {name: [] for name in sets}
    with tempfile.TemporaryDirectory() as workdir:
        for seed in seeds:
            for name in sets:
                overrides = [*COMMON, *SETS[name], f"train.seed={seed}", *extra]
                runs[name].append(side_by_side(overrides, [SAME_STEPS_DECODED], Path(workdir) / f"{name}-{seed}"))
    rows = []
    for name in sets:
        ours, theirs = (
            [run["pipeline"] for run in runs[name]],
            [run["/".join(SAME_STEPS_DECODED)] for run in runs[name]],
        )
        label = "plain loop: the pipeline's steps, decoded once, in memory"
        rows.append(comparison(f"feed alone, {name}", label, "like for like", ours, theirs))
    print(comparisons_table(rows), flush=True)
    write("feed", runs, rows)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="The feed alone: the pipeline against a DataLoader, no model.")
    parser.add_argument("--sets", default=",".join(SETS), help=f"comma-separated, of {', '.join(SETS)}")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated train.seed values")
    arguments, rest = parser.parse_known_args()
    main(arguments.sets.split(","), [int(s) for s in arguments.seeds.split(",")], rest)
