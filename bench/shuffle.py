"""Shuffle quality when an epoch is many read tasks deep: CIFAR-10's training rows stored a file per class (row
groups of 1,000 rows), streamed (``ingest.cache=false``) by read tasks of about one row group each
(``ingest.read_task_mib=3``: 50 tasks an epoch), against the same rows as stored (shuffled), the class-sorted copy
rewritten by ``python -m pipeline.reshuffle``, and the class-sorted rows read by tasks of the default size (64 MiB:
about 20 row groups). Every run: ``bench/probe.py``'s linear classifier, 2 epochs, one training worker, the same
seeds; val_accuracy and label_mix read back from MLflow, and whether the run warned before training.

Beside them, what Ray Data's own parts mix on the class-sorted copy: ``read_parquet`` with a seeded file shuffle,
and ``iter_batches`` with a local shuffle buffer as large as a read task's rows here (1,000 rows) and ten times that.

``photos``: photos at real sizes (``source=photos``, 3,200 rows, ``transforms=imagenet``, the probe over the 224
crops) stored as a user's export often is, a file per class of one row group each (pyarrow's default), streamed with
the defaults (``ingest.cache=false``, nothing else), against the same rows stored shuffled and against the plain loop
over the class-sorted rows, a ``DataLoader`` with ``shuffle=True`` (``bench/plain.py``, torchvision's decode and
transforms).

    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 PIPELINE_DATA_DIR=../shared/data python bench/shuffle.py \\
        [--sets cifar,photos] [--seeds 0,1,2]

About 2 minutes a run. Prints a table per set and writes outputs/bench/shuffle.json.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from ingest import COMMON, PHOTOS, sorted_copy
from report import data_dir, pipeline_run, plain_run, table, write

from pipeline.api import compose
from pipeline.data import source

BENCH = Path(__file__).resolve().parent
DEEP = ["ingest.cache=false", "train.epochs=2"]
ONE_GROUP = "ingest.read_task_mib=3"  # a read task of about one row group of 1,000 CIFAR-10 rows
BATCH = 128
PHOTO_ROWS = 3200
PHOTO_SET = [
    *PHOTOS,
    "ingest.cache=false",  # streamed, every other setting its default
    f"source.download.rows={PHOTO_ROWS}",
    "+source.download.name=photos_shuffle",
    "source.valid=${source.root}/photos_shuffle/valid",
]
PHOTO_TRAIN = "source.train=${source.root}/photos_shuffle/train"  # as written: shuffled


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


def photos_by_class(root: Path) -> tuple[str, str]:
    """The photo set (written when missing) and ``root``'s copy of its training rows a file per class, each file one
    row group (pyarrow's default): the shuffled and the class-sorted training directories."""
    searchpath = f"hydra.searchpath=[file://{BENCH / 'conf'}]"
    stored = source.prepare(compose([*COMMON, *PHOTO_SET, PHOTO_TRAIN, searchpath]).source)["train"]
    table = pq.read_table(stored.files, columns=["image", "label"])
    target = root / "photos_by_class"
    target.mkdir(parents=True)
    for label in sorted(set(table["label"].to_pylist())):
        pq.write_table(table.filter(pa.compute.equal(table["label"], label)), target / f"class-{label}.parquet")
    return str(Path(stored.files[0]).parent), str(target)


def photos(seeds: list[int], work: Path) -> dict:
    """val_accuracy of class-sorted photos streamed with the defaults (and without the shuffle buffer, as before issue
    82), of the same rows stored shuffled, and of a DataLoader with shuffle=True over the class-sorted rows, per
    seed."""
    shuffled, by_class = photos_by_class(work)
    sides = {  # the pipeline's: its training rows, and what else differs from the defaults
        "pipeline, stored shuffled": [f"source.train={shuffled}"],
        "pipeline, stored by class": [f"source.train={by_class}"],
        "pipeline, stored by class, no shuffle buffer": [
            f"source.train={by_class}",
            "ingest.local_shuffle_buffer_size=null",
        ],
    }
    runs = {name: [] for name in [*sides, "DataLoader(shuffle=True), by class"]}
    searchpath = f"hydra.searchpath=[file://{BENCH / 'conf'}]"
    for seed in seeds:
        base = ["--config-dir", str(BENCH / "conf"), *COMMON, *PHOTO_SET, f"train.seed={seed}"]
        for number, (name, changes) in enumerate(sides.items()):
            log = work / f"photos{number}-{seed}.log"  # paths Hydra's override grammar takes: no spaces
            figures = pipeline_run([*base, *changes], work / f"photos{number}-{seed}", log=log)
            figures["warned"] = "looks sorted by label" in log.read_text()
            runs[name].append(figures)
        plain = plain_run("encoded", "torchvision", [*base[2:], f"source.train={by_class}", searchpath])
        runs["DataLoader(shuffle=True), by class"].append(plain)
        print("photos", seed, {name: got[-1]["val_accuracy"][-1] for name, got in runs.items()}, flush=True)
    return runs


def cifar(seeds: list[int], work: Path) -> dict:
    """val_accuracy, label_mix and the warning of each CIFAR-10 layout, per seed."""
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
    for seed in seeds:
        for number, (name, source_args) in enumerate(layouts.items()):
            args = ["--config-dir", str(BENCH / "conf"), *COMMON, *DEEP, *source_args, f"train.seed={seed}"]
            log = work / f"layout{number}-{seed}.log"  # paths Hydra's override grammar takes: no spaces
            figures = pipeline_run(args, work / f"layout{number}-{seed}", log=log)
            figures["warned"] = "looks sorted by label" in log.read_text()
            runs[name].append(figures)
            print(name, seed, figures["val_accuracy"], figures["warned"], flush=True)
    return runs


def summarize(runs: dict, base: str) -> dict:
    """Each layout's mean val_accuracy, against ``base``'s, printed as a table."""
    rows, summary = [], {}
    for name, got in runs.items():
        accuracy = [run["val_accuracy"][-1] for run in got]
        summary[name] = {"val_accuracy_mean": round(float(np.mean(accuracy)), 4), "runs": got}
        warned = sum(run.get("warned", False) for run in got)
        mix = np.mean([run["label_mix"][-1] for run in got]) if "label_mix" in got[0] else float("nan")
        per_seed = " / ".join(f"{a:.3f}" for a in accuracy)
        rows.append((name, f"{np.mean(accuracy):.3f}", per_seed, f"{mix:.2f}", f"{warned}/{len(got)}"))
    for name in summary:
        summary[name]["vs_" + base] = round(summary[name]["val_accuracy_mean"] / summary[base]["val_accuracy_mean"], 3)
    print(table(rows, ("layout", "val_accuracy (mean)", "per seed", "label_mix", "warned")))
    return summary


def main(sets: list[str], seeds: list[int]) -> dict:
    data_dir()
    figures: dict = {"seeds": seeds}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if "photos" in sets:
            figures["photos"] = summarize(photos(seeds, work), "pipeline, stored shuffled")
        if "cifar" in sets:
            figures["layouts"] = summarize(cifar(seeds, work), "stored (shuffled)")
            figures["ray_data_label_mix"] = ray_data_mix(sorted_copy(work / "sorted"), [1000, 10_000])
            for buffer, mix in figures["ray_data_label_mix"].items():
                print(f"Ray Data, file shuffle + local buffer of {buffer:,} rows, on the class-sorted rows: {mix}")
    write("shuffle", figures)
    return figures


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Shuffle quality of a class-sorted split many read tasks deep.")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated train.seed values")
    parser.add_argument("--sets", default="photos,cifar", help="comma-separated, of photos and cifar")
    arguments = parser.parse_args()
    main(arguments.sets.split(","), [int(s) for s in arguments.seeds.split(",")])
