"""Shuffle quality when an epoch is many read tasks deep: CIFAR-10's training rows stored a file per class (row
groups of 1,000 rows), streamed (``ingest.cache=false``) by read tasks of about one row group each
(``ingest.read_task_mib=3``: 50 tasks an epoch), against the same rows as stored (shuffled), the class-sorted copy
rewritten by ``python -m pipeline.reshuffle``, and the class-sorted rows read by tasks of the default size (64 MiB:
about 20 row groups). Every run: ``bench/probe.py``'s linear classifier, 2 epochs, one training worker, the same
seeds; val_accuracy and label_mix read back from MLflow, and whether the run warned before training.

Beside them, what Ray Data's own parts mix on the class-sorted copy: ``read_parquet`` with a seeded file shuffle,
and ``iter_batches`` with a local shuffle buffer as large as a read task's rows here (1,000 rows) and ten times that.

    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 PIPELINE_DATA_DIR=../shared/data python bench/shuffle.py [--seeds 0,1,2]

About 2 minutes a run. Prints a table and writes outputs/bench/shuffle.json.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from ingest import COMMON, sorted_copy
from report import data_dir, pipeline_run, table, write

BENCH = Path(__file__).resolve().parent
DEEP = ["ingest.cache=false", "train.epochs=2"]
ONE_GROUP = "ingest.read_task_mib=3"  # a read task of about one row group of 1,000 CIFAR-10 rows
BATCH = 128


def reshuffled(sorted_root: Path, root: Path) -> Path:
    """``root/cifar10``: the class-sorted training rows rewritten by ``python -m pipeline.reshuffle``."""
    target = root / "cifar10"
    if not (target / "train").exists():
        command = [sys.executable, "-m", "pipeline.reshuffle", str(sorted_root / "cifar10" / "train")]
        subprocess.run([*command, str(target / "train"), "--rows-per-group", "1000"], check=True)
        (target / "test").symlink_to(Path(data_dir()) / "cifar10" / "test")
    return root


def ray_data_mix(sorted_root: Path, buffers: list[int]) -> dict[int, float]:
    """label_mix of Ray Data's file shuffle and a local shuffle buffer of each size, over one pass of the
    class-sorted rows in batches of ``BATCH``."""
    import ray
    import ray.data

    from pipeline.training.telemetry import label_mix

    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    files = sorted(str(f) for f in (sorted_root / "cifar10" / "train").glob("*.parquet"))
    mixes = {}
    for buffer in buffers:
        ds = ray.data.read_parquet(files, columns=["label"], shuffle=ray.data.FileShuffleConfig(seed=0))
        batches = [b["label"] for b in ds.iter_batches(batch_size=BATCH, local_shuffle_buffer_size=buffer)]
        counts = np.bincount(np.concatenate(batches), minlength=10)
        distinct = np.mean([len(np.unique(b)) for b in batches])
        mixes[buffer] = round(label_mix(counts.tolist(), float(distinct), BATCH), 3)
    ray.shutdown()
    return mixes


def main(seeds: list[int]) -> dict:
    data_dir()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        sorted_root = sorted_copy(work / "sorted")
        by_class = [f"source.root={sorted_root}", "source.download=null"]
        layouts = {
            "stored (shuffled)": [ONE_GROUP],
            "stored by class": [*by_class, ONE_GROUP],
            "by class, reshuffled": [
                f"source.root={reshuffled(sorted_root, work / 'reshuffled')}",
                "source.download=null",
                ONE_GROUP,
            ],
            "stored by class, tasks of 64 MiB (the default)": by_class,
        }
        runs = {name: [] for name in layouts}
        env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(BENCH), os.environ.get("PYTHONPATH")]))}
        for seed in seeds:
            for number, (name, source) in enumerate(layouts.items()):
                args = ["--config-dir", str(BENCH / "conf"), *COMMON, *DEEP, *source, f"train.seed={seed}"]
                log = work / f"layout{number}-{seed}.log"  # paths Hydra's override grammar takes: no spaces
                figures = pipeline_run(args, work / f"layout{number}-{seed}", env, log=log)
                figures["warned"] = "looks sorted by label" in log.read_text()
                runs[name].append(figures)
                print(name, seed, figures["val_accuracy"], figures["warned"], flush=True)
        ray_data = ray_data_mix(sorted_root, [1000, 10_000])
    rows = []
    summary = {}
    for name, got in runs.items():
        accuracy = [run["val_accuracy"][-1] for run in got]
        summary[name] = {"val_accuracy_mean": round(float(np.mean(accuracy)), 4), "runs": got}
        warned = sum(run["warned"] for run in got)
        mix = np.mean([run["label_mix"][-1] for run in got])
        per_seed = " / ".join(f"{a:.3f}" for a in accuracy)
        rows.append((name, f"{np.mean(accuracy):.3f}", per_seed, f"{mix:.2f}", f"{warned}/{len(got)}"))
    base = summary["stored (shuffled)"]["val_accuracy_mean"]
    for name in summary:
        summary[name]["vs_stored"] = round(summary[name]["val_accuracy_mean"] / base, 3)
    print(table(rows, ("layout", "val_accuracy (mean)", "per seed", "label_mix", "warned")))
    for buffer, mix in ray_data.items():
        print(f"Ray Data, file shuffle + local buffer of {buffer:,} rows, on the class-sorted rows: label_mix {mix}")
    write("shuffle", {"seeds": seeds, "layouts": summary, "ray_data_label_mix": ray_data})
    return summary


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Shuffle quality of a class-sorted split many read tasks deep.")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated train.seed values")
    main([int(s) for s in parser.parse_args().seeds.split(",")])
