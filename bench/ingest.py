"""Feeding the trainer: whole training runs bound by ingest, the pipeline with its defaults against the
plain PyTorch loop a competent user writes, side by side, on four image sets:

- ``cifar``: CIFAR-10 as stored (50,000 32x32 JPEGs, pre-shuffled): decode, pad + crop, flip;
- ``photos``: ``source=photos`` (6,400 JPEGs, shorter side 256-512 px, written offline when missing),
  ``transforms=imagenet``: random-resized-crop to 224 + flip;
- ``sorted``: the same CIFAR-10 rows stored class by class (a file per class), as many users' data is;
  the pipeline also runs with ``ingest.shuffle=false`` there (its throughput bound; it cannot learn);
- ``streamed``: 40,000 such photos with ``ingest.cache=false``, so every epoch is read and decoded anew, as
  data larger than memory is (the plain loop's epoch lasts over 30 s on 2 cores).

The photo sets are written under outputs/bench/data when missing (about 3 minutes for both).

Both sides train the same cheap model (``bench/probe.py``: a linear classifier on uint8 pixels; the
pixels' scaling, a GPU's work on a GPU node, left out on both sides) with the same optimizer, batch size,
seed and epochs, so the data path is what is measured:

- pipeline: ``python -m pipeline`` with the set's source and transforms and its defaults otherwise
  (cache auto, shuffle on, one training worker of one CPU, the local runtime's CPUs as it sets them);
  samples/s, ``data_wait_fraction`` and val_accuracy per epoch read back from its MLflow run;
- plain loop: one process, ``DataLoader(shuffle=True, num_workers=<cores>, persistent_workers=True)``
  over a map-style Dataset doing the same steps per sample (``bench/plain.py``: torchvision's decoder,
  its v2 transforms for photos, the lean hand-written crop + flip for CIFAR, the faster there);
- the model alone, fed one batch from memory over and over: it must run at least 3x faster than either
  side, or the run measures the model, not the feeding.

    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 PIPELINE_DATA_DIR=../shared/data \\
        python bench/ingest.py [--sets cifar,photos,sorted,streamed] [--seeds 0,1,2] [OVERRIDES...]

Extra arguments are config overrides for the pipeline side. About 10 minutes per seed on 2 cores
(the streamed set: 3).
Prints a table per set (ranges over the seeds) and writes outputs/bench/ingest.json.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import plain
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from hydra.utils import instantiate
from report import data_dir, pipeline_run, table, write

from pipeline.config import PipelineConfig
from pipeline.data import source

BENCH = Path(__file__).resolve().parent
BENCH_DATA = (BENCH.parent / "outputs" / "bench" / "data").resolve()  # the photo sets, written once when missing
EPOCHS = 3
COMMON = [
    "model=probe",  # bench/conf/model/probe.yaml
    f"train.epochs={EPOCHS}",
    "scaling.num_workers=1",
    "scaling.resources_per_worker.CPU=1",
    "ingest.batch_size=128",
    "ingest.normalize=null",
    "tracking.system_metrics_s=null",
    "tracking.log_model=false",
]
PHOTOS = ["source=photos", "transforms=imagenet", "model.size=224", "model.stride=8", f"source.root={BENCH_DATA}"]
STREAMED_ROWS = 40_000  # the plain loop's epoch over them lasts more than 30 s on 2 cores: fixed costs do not decide
SETS = {
    "cifar": {"overrides": ["model.stride=1"], "lean": True},
    "photos": {"overrides": PHOTOS, "lean": False},
    "sorted": {"overrides": ["model.stride=1", "source.download=null"], "lean": True, "unshuffled": True},
    "streamed": {
        "overrides": [
            *PHOTOS,
            "ingest.cache=false",  # streamed every epoch, as data larger than memory is
            f"source.download.rows={STREAMED_ROWS}",
            "+source.download.files=100",
            "+source.download.name=photos_streamed",
            "source.train=${source.root}/photos_streamed/train",
            "source.valid=${source.root}/photos_streamed/valid",
        ],
        "lean": False,
    },
}


def sorted_copy(root: Path) -> Path:
    """``root/cifar10``: CIFAR-10's training rows stored class by class (a file per class, row groups of
    1,000), its test split as it is; written once."""
    train, test = Path(data_dir()) / "cifar10" / "train", Path(data_dir()) / "cifar10" / "test"
    target = root / "cifar10"
    if not (target / "train").exists():
        table = pq.read_table(sorted(train.glob("*.parquet")))
        (target / "train").mkdir(parents=True)
        for label in range(10):
            rows = table.filter(pa.compute.equal(table["label"], label))
            pq.write_table(rows, target / "train" / f"class-{label}.parquet", row_group_size=1000)
        (target / "test").symlink_to(test)
    return root


def model_alone(
    cfg: PipelineConfig,
    images: torch.Tensor,
    labels: torch.Tensor,
    steps: int = 100,
    repeats: int = 5,
    torch_threads: int = 1,
) -> int:
    """Samples/s of the model's training step on one batch held in memory, on ``torch_threads`` threads (one:
    the training worker's share here), the best of ``repeats`` (the plain loop's workers may still be
    exiting): the most either side could reach if feeding cost nothing."""
    threads = torch.get_num_threads()
    torch.set_num_threads(torch_threads)
    model = instantiate(cfg.model, _convert_="all")
    optimizer = instantiate(cfg.optim, params=model.parameters(), _convert_="all")
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            loss = torch.nn.functional.cross_entropy(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        rates.append(round(steps * len(labels) / (time.perf_counter() - start)))
    torch.set_num_threads(threads)
    return max(rates)


def measure(name: str, seed: int, extra: list[str], workdir: Path) -> dict:
    """One set, one seed: the pipeline (and, for ``sorted``, unshuffled), the plain loop, the model alone."""
    from pipeline.api import compose

    spec = SETS[name]
    root = [f"source.root={sorted_copy(workdir / 'sorted-data')}"] if name == "sorted" else []
    overrides = [*COMMON, *spec["overrides"], *root, f"train.seed={seed}", *extra]
    cfg = compose([*overrides, f"hydra.searchpath=[file://{BENCH / 'conf'}]"])
    source.prepare(cfg.source)  # a photo set is written now, when missing: not in the pipeline's timed start
    args = ["--config-dir", str(BENCH / "conf"), *overrides]
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(BENCH), os.environ.get("PYTHONPATH")]))}
    out = {"pipeline": pipeline_run(args, workdir / f"{name}-{seed}", env)}
    if spec.get("unshuffled"):
        out["pipeline_unshuffled"] = pipeline_run([*args, "ingest.shuffle=false"], workdir / f"{name}-{seed}-u", env)
    out["plain"] = plain.train(cfg, lean=spec["lean"], shuffle=True)
    images, labels = next(iter(plain.loader(cfg, "valid", training=False)))
    out["model_alone"] = model_alone(cfg, images, labels)
    return out


def span(values: list[float], digits: int = 0) -> str:
    """``low - high`` of a figure over the seeds (one value: itself)."""
    low, high = round(min(values), digits), round(max(values), digits)
    fmt = (lambda v: f"{v:,.{digits}f}") if digits else (lambda v: f"{v:,.0f}")
    return fmt(low) if low == high else f"{fmt(low)} - {fmt(high)}"


def summary(name: str, runs: list[dict]) -> dict:
    """Per epoch, ranges over the seeds: each side's samples/s and data wait, their ratio, accuracy."""
    sides = [side for side in ("pipeline", "pipeline_unshuffled", "plain") if side in runs[0]]
    figures: dict = {"runs": runs}
    rows = []
    for side in sides:
        per_epoch = list(zip(*(run[side]["samples_s"] for run in runs)))
        waits = list(zip(*(run[side]["data_wait_fraction"] for run in runs)))
        accuracy = [run[side]["val_accuracy"][-1] for run in runs]
        figures[side] = {"val_accuracy_mean": round(float(np.mean(accuracy)), 4)}
        rows.append((side, *(span(e) for e in per_epoch), span(accuracy, 3)))
        rows.append(("  data_wait_fraction", *(span(w, 2) for w in waits), ""))
    ratios = [[p / q for p, q in zip(run["pipeline"]["samples_s"], run["plain"]["samples_s"])] for run in runs]
    figures["pipeline_over_plain"] = [[round(r, 2) for r in run] for run in ratios]
    rows.append(("pipeline / plain", *(span(list(e), 2) + "x" for e in zip(*ratios)), ""))
    if "pipeline_unshuffled" in runs[0]:
        bound = [
            [p / q for p, q in zip(run["pipeline"]["samples_s"], run["pipeline_unshuffled"]["samples_s"])]
            for run in runs
        ]
        figures["shuffled_over_unshuffled"] = [[round(r, 2) for r in run] for run in bound]
        rows.append(("shuffled / unshuffled", *(span(list(e), 2) + "x" for e in zip(*bound)), ""))
    alone = [run["model_alone"] for run in runs]
    fastest = max(max(run[side]["samples_s"]) for run in runs for side in sides)
    figures["model_alone_over_fastest_side"] = round(min(alone) / fastest, 1)
    rows.append((f"model alone (from memory): {span(alone)} samples/s", "", "", "", ""))
    rows.append((f"  / the fastest side's epoch: {figures['model_alone_over_fastest_side']}x", "", "", "", ""))
    startup = [run["pipeline"]["startup_s"] for run in runs]
    cache = [c for run in runs for c in run["pipeline"]["cache_train_s"]]
    rows.append(
        (f"pipeline startup_s {span(startup, 1)}, cache built in {span(cache, 1) if cache else '-'} s", "", "", "", "")
    )
    header = (f"{name} (samples/s)", *(f"epoch {e + 1}" for e in range(EPOCHS)), "val_accuracy")
    print(f"\n{name}, seeds {len(runs)}\n" + table(rows, header), flush=True)
    return figures


def main(sets: list[str], seeds: list[int], extra: list[str]) -> dict:
    data_dir()
    with tempfile.TemporaryDirectory() as tmp:
        runs = {name: [measure(name, seed, extra, Path(tmp)) for seed in seeds] for name in sets}
    figures = {name: summary(name, runs[name]) for name in sets}
    if {"cifar", "sorted"} <= set(sets):
        gap = figures["sorted"]["pipeline"]["val_accuracy_mean"] - figures["cifar"]["pipeline"]["val_accuracy_mean"]
        figures["sorted_minus_stored_shuffled_accuracy"] = round(gap, 4)
        print(f"\nclass-sorted minus pre-shuffled val_accuracy (pipeline, mean over seeds): {gap:+.4f}")
    write("ingest", figures)
    return figures


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description="Whole training runs bound by ingest: the pipeline against a plain loop."
    )
    parser.add_argument("--sets", default=",".join(SETS), help=f"comma-separated, of {', '.join(SETS)}")
    parser.add_argument(
        "--seeds", default="0,1,2", help="comma-separated train.seed values, one run of each side per seed"
    )
    arguments, rest = parser.parse_known_args()
    main(arguments.sets.split(","), [int(s) for s in arguments.seeds.split(",")], rest)
