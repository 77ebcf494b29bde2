"""The quick start's training: ``python -m pipeline +experiment=cifar_vit_cpu`` (2 epochs, two DDP workers of
one thread each) as a user runs it, against the plain PyTorch loop with the same model, optimizer, schedule,
batch size, seed and data, over seeds, one after the other:

- pipeline: samples/s per epoch, val_accuracy and startup_s read back from its MLflow run;
- plain loop: ``bench/plain.py`` in a process of its own (torchvision's flip over CIFAR-10 decoded once and held
  in memory, as the pipeline caches it; two torch threads, the cores the pipeline's workers share);

each timed from its command to its last validation as well as per epoch.

    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 PIPELINE_DATA_DIR=../shared/data \\
        python bench/train.py [--seeds 0,1,2] [OVERRIDES...]

Extra arguments are config overrides for both sides. About 9 minutes per seed on 2 cores. Prints a table and
writes outputs/bench/train.json.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from report import comparison, comparisons_table, data_dir, pipeline_run, plain_run, write

EXPERIMENT = ["+experiment=cifar_vit_cpu"]
PLAIN_THREADS = ["scaling.torch_threads=2"]  # one process: both cores' threads


def main(seeds: list[int], extra: list[str]) -> None:
    data_dir()
    ours, theirs = [], []
    with tempfile.TemporaryDirectory() as workdir:
        for seed in seeds:
            args = [*EXPERIMENT, f"train.seed={seed}", *extra]
            ours.append(pipeline_run(args, Path(workdir) / str(seed)))
            theirs.append(plain_run("decoded", "torchvision", [*args, *PLAIN_THREADS]))
    row = comparison(
        "quick start: cifar_vit_cpu",
        "plain loop: torchvision's transforms, decoded once, in memory",
        "like for like",
        ours,
        theirs,
    )
    print(comparisons_table([row]))
    write("train", {"pipeline": ours, "plain": theirs}, [row])


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="The quick start's training against the plain loop.")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated train.seed values")
    arguments, rest = parser.parse_known_args()
    main([int(s) for s in arguments.seeds.split(",")], rest)
