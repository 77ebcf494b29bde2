"""On a GPU: the flagship and the photos against the plain PyTorch loop at its strongest (``bench/plain.py``: a
worker per core, persistent, pinned memory, uint8 batches normalized on the device), side by side in one session:

- ``+experiment=cifar_vit`` (ViT-12L/384, global batch 512, one GPU worker over nccl), float32 and bfloat16
  autocast over ``--seeds`` each, against the loop holding CIFAR-10 decoded in memory (the pipeline caches it);
- the GPU levers on top of bfloat16, pipeline only: ``train.compile=true`` and ``scaling.strategy=fsdp``;
- ``+experiment=photos_resnet`` (ResNet-18 on real-size photos, crops to 224), against the same steps in a
  DataLoader over the working size in memory (like for like) and torchvision's usual full decode every epoch: with
  its defaults the crop runs on the GPU (``on_device: auto``) and the workers read the cache themselves; the same
  with the crop in Ray Data's CPU tasks (``on_device=false``), pipeline only;
- the photos streamed (``ingest.cache=false``): each epoch's JPEG bytes decoded on the GPU (nvJPEG) and cropped
  there, against the same steps and torchvision's usual code, each decoding every epoch in a DataLoader.

Each side is a command of its own, timed from its start to its last validation as well as per epoch.

    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 PIPELINE_DATA_DIR=/path/to/data python bench/gpu.py [--epochs 3] [--seeds 3]
        [--only "cifar_vit bfloat16" ...]

Prints a table and writes outputs/bench/gpu.json; each command's console goes to outputs/bench/gpu-<name>.log.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from report import OUT_DIR, comparison, comparisons_table, data_dir, describe, pipeline_run, plain_run, write

from pipeline.api import compose
from pipeline.data import source

BF16 = ["train.amp=true", "train.amp_dtype=bfloat16"]
# name: (overrides, the plain loop's baselines: --data, --transforms of bench/plain.py); cached unless named streamed
RUNS = {
    "cifar_vit float32": (["+experiment=cifar_vit"], [("decoded", "torchvision")]),
    "cifar_vit bfloat16": (["+experiment=cifar_vit", *BF16], [("decoded", "torchvision")]),
    "cifar_vit bfloat16 compile": (["+experiment=cifar_vit", *BF16, "train.compile=true"], []),
    "cifar_vit bfloat16 fsdp": (["+experiment=cifar_vit", *BF16, "scaling.strategy=fsdp"], []),
    "photos_resnet bfloat16": (
        ["+experiment=photos_resnet", *BF16],
        [("decoded", "pipeline"), ("encoded", "torchvision")],
    ),
    "photos_resnet bfloat16 crops on the CPUs": (
        ["+experiment=photos_resnet", *BF16, "transforms.train.crop.on_device=false"],
        [],
    ),
    "photos_resnet bfloat16 streamed": (
        ["+experiment=photos_resnet", *BF16, "ingest.cache=false"],
        [("encoded", "pipeline"), ("encoded", "torchvision")],
    ),
}


def main(epochs: int, seeds: int, only: list[str]) -> None:
    data_dir()
    card = torch.cuda.get_device_name(0).removeprefix("NVIDIA ")  # the rows say which GPU
    settings = [f"train.epochs={epochs}", "tracking.log_model=false"]  # export is after training: not timed here
    figures, rows = {}, []
    with tempfile.TemporaryDirectory() as workdir:
        for name, (overrides, baselines) in RUNS.items():
            if only and name not in only:
                continue
            source.prepare(compose(overrides).source)  # the photos are written once, outside any timed run
            ours, theirs = [], {baseline: [] for baseline in baselines}
            for seed in range(seeds if baselines else 1):
                args = [*overrides, *settings, f"train.seed={seed}"]
                tag = f"{name.replace(' ', '-')}-{seed}"
                ours.append(pipeline_run(args, Path(workdir) / tag, log=OUT_DIR / f"gpu-{tag}.log"))
                for data, transforms in baselines:
                    log = OUT_DIR / f"gpu-{tag}-plain-{data}-{transforms}.log"
                    theirs[data, transforms].append(plain_run(data, transforms, args, "cuda", log))
            figures[name] = {"pipeline": ours, **{"/".join(baseline): runs for baseline, runs in theirs.items()}}
            for baseline, runs in theirs.items():
                cached = "ingest.cache=false" not in overrides
                rows.append(comparison(f"{card}: {name}", *describe(baseline, cached=cached), ours, runs))
            write("gpu", figures, rows)  # after each configuration: a run cut short keeps what it measured
    print(comparisons_table(rows))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="The GPU rows: pipeline against the strong plain loop.")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--seeds", type=int, default=3, help="runs of each compared configuration")
    parser.add_argument("--only", action="append", default=[], choices=list(RUNS), help="these configurations only")
    arguments = parser.parse_args()
    main(arguments.epochs, arguments.seeds, arguments.only)
