"""Feeding the trainer: whole training runs bound by ingest, the pipeline with its defaults against the plain
PyTorch loop a competent user writes (``bench/plain.py``), side by side, over seeds, on three image sets:

- ``cifar``: CIFAR-10 as stored (50,000 32x32 JPEGs, pre-shuffled): decode, pad + crop, flip. The pipeline
  caches the decoded rows, so the like-for-like loop holds them decoded in memory too (as torchvision's CIFAR10
  does), with the pipeline's steps and with torchvision's; the loop that decodes every epoch is a row of its
  own, labelled so.
- ``photos``: ``source=photos`` (6,400 JPEGs, shorter side 256-512 px), ``transforms=imagenet``: cached at a
  256-pixel working size, then a random-resized crop to 224 + flip every epoch. Like for like: the same steps
  in a DataLoader over the working size held in memory; the usual code (torchvision's full decode and
  ``RandomResizedCrop`` every epoch) is labelled as a cache against a re-decode.
- ``streamed``: 40,000 such photos with ``ingest.cache=false``, so every epoch is read and decoded anew, as
  data larger than memory is: against the same steps in a DataLoader (what the engine costs) and against
  torchvision's usual transforms (what users have).

The photo sets are written under outputs/bench/data when missing (about 3 minutes for both).

Both sides train the same cheap model (``bench/probe.py``: a linear classifier on uint8 pixels; the pixels'
scaling, a GPU's work on a GPU node, left out on both sides) with the same optimizer, batch size, seed, shuffle
and epochs, so the data path is what is measured. Each side is a command of its own, timed from its start to
its last validation as well as per epoch; the model alone, fed one batch from memory over and over, must run
at least 3x faster than either side, or the run measures the model, not the feeding.

    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 PIPELINE_DATA_DIR=../shared/data \\
        python bench/ingest.py [--sets cifar,photos,streamed] [--seeds 0,1,2] [OVERRIDES...]

Extra arguments are config overrides for both sides. About 4 minutes per seed and set on 2 cores.
Prints a table per set and writes outputs/bench/ingest.json.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import plain
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from hydra.utils import instantiate
from report import comparison, comparisons_table, data_dir, describe, pipeline_run, plain_run, write

from pipeline.config import PipelineConfig
from pipeline.data import source

BENCH = Path(__file__).resolve().parent
BENCH_DATA = (BENCH.parent / "outputs" / "bench" / "data").resolve()  # the photo sets, written once when missing
EPOCHS = 3
ONE_WORKER = [  # one training worker of one CPU, batches of 128 uint8 images, nothing logged but the figures
    "scaling.num_workers=1",
    "scaling.resources_per_worker.CPU=1",
    "ingest.batch_size=128",
    "ingest.normalize=null",
    "tracking.system_metrics_s=null",
    "tracking.log_model=false",
]
COMMON = ["model=probe", f"train.epochs={EPOCHS}", *ONE_WORKER]  # bench/conf/model/probe.yaml
PHOTO_DATA = ["source=photos", "transforms=imagenet", f"source.root={BENCH_DATA}"]
PHOTOS = [*PHOTO_DATA, "model.size=224", "model.stride=8"]  # the probe over every 8th pixel of the 224 crops
STREAMED_ROWS = 40_000  # the plain loop's epoch over them lasts more than 20 s on 2 cores: fixed costs do not decide
# a baseline: (--data, --transforms) of bench/plain.py
SAME_STEPS_DECODED, TORCHVISION_DECODED = ("decoded", "pipeline"), ("decoded", "torchvision")
SAME_STEPS, TORCHVISION = ("encoded", "pipeline"), ("encoded", "torchvision")
SETS = {
    "cifar": {"overrides": ["model.stride=1"], "baselines": [SAME_STEPS_DECODED, TORCHVISION_DECODED, TORCHVISION]},
    "photos": {"overrides": PHOTOS, "baselines": [SAME_STEPS_DECODED, TORCHVISION]},
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
        "baselines": [SAME_STEPS, TORCHVISION],
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


def side_by_side(overrides: list[str], baselines: list[tuple[str, str]], outputs: Path) -> dict:
    """The pipeline (its outputs in ``outputs``) and each of ``baselines``, one command after another, on the same
    ``overrides`` (bench/conf's models on the search path); a photo set is written first, when missing, outside
    either side's timed run."""
    from pipeline.api import compose

    searchpath = f"hydra.searchpath=[file://{BENCH / 'conf'}]"
    source.prepare(compose([*overrides, searchpath]).source)
    out = {"pipeline": pipeline_run(["--config-dir", str(BENCH / "conf"), *overrides], outputs)}
    for baseline in baselines:
        out["/".join(baseline)] = plain_run(*baseline, [*overrides, searchpath])
    return out


def measure(name: str, seed: int, extra: list[str], workdir: Path) -> dict:
    """One set, one seed: the pipeline, each baseline, the model alone."""
    from pipeline.api import compose

    overrides = [*COMMON, *SETS[name]["overrides"], f"train.seed={seed}", *extra]
    out = side_by_side(overrides, SETS[name]["baselines"], workdir / f"{name}-{seed}")
    cfg = compose([*overrides, f"hydra.searchpath=[file://{BENCH / 'conf'}]"])
    batch = plain.rows(cfg, "valid", *SAME_STEPS).__getitems__([(0, i) for i in range(cfg.ingest.batch_size)])
    out["model_alone"] = model_alone(cfg, *batch)
    return out


def summary(name: str, runs: list[dict]) -> tuple[dict, list[dict]]:
    """The set's comparisons (a row of docs/figures.md per baseline), printed as a table."""
    cached = "ingest.cache=false" not in SETS[name]["overrides"]
    rows = []
    for baseline in SETS[name]["baselines"]:
        label, kind = describe(baseline, cached)
        theirs = [run["/".join(baseline)] for run in runs]
        rows.append(comparison(f"ingest-bound, {name}", label, kind, [run["pipeline"] for run in runs], theirs))
    alone = [run["model_alone"] for run in runs]
    fastest = max(max(side["samples_s"]) for run in runs for key, side in run.items() if key != "model_alone")
    figures = {"runs": runs, "model_alone_over_fastest_side": round(min(alone) / fastest, 1)}
    print(f"\n{name}, {len(runs)} seeds; the model alone runs {figures['model_alone_over_fastest_side']}x the fastest")
    print(comparisons_table(rows), flush=True)
    return figures, rows


def main(sets: list[str], seeds: list[int], extra: list[str]) -> dict:
    data_dir()
    with tempfile.TemporaryDirectory() as tmp:
        runs = {name: [measure(name, seed, extra, Path(tmp)) for seed in seeds] for name in sets}
    figures, rows = {}, []
    for name in sets:
        figures[name], set_rows = summary(name, runs[name])
        rows += set_rows
    write("ingest", figures, rows)
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
