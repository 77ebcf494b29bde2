"""The flagship on a GPU: ``+experiment=cifar_vit`` (ViT-12L/384, global batch 512, one GPU worker, DDP over
nccl) against the plain PyTorch loop with the same recipe on the same GPU, in float32 and with bfloat16 autocast
(``train.amp=true``), side by side in one session. Per epoch: samples/s, data_wait_fraction (the share of the
training loop spent waiting for its next batch: is the GPU fed?) and val_accuracy.

    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 PIPELINE_DATA_DIR=/path/with/cifar10 python bench/gpu.py [EPOCHS]

The plain loop's DataLoader has a worker per core (``bench/plain.py``). Prints a table and writes
outputs/bench/gpu.json; each pipeline command's console goes to outputs/bench/gpu-<name>.log.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import plain
import torch
from report import OUT_DIR, data_dir, pipeline_run, table, write

from pipeline.api import compose

EXPERIMENT = ["+experiment=cifar_vit"]
PRECISIONS = {"float32": [], "bfloat16": ["train.amp=true", "train.amp_dtype=bfloat16"]}


def main(epochs: int) -> None:
    data_dir()
    settings = [f"train.epochs={epochs}", "tracking.log_model=false"]  # export is after training: not timed here
    figures: dict = {"device": torch.cuda.get_device_name(0), "epochs": epochs}
    with tempfile.TemporaryDirectory() as workdir:
        for name, precision in PRECISIONS.items():
            args = [*EXPERIMENT, *settings, *precision]
            log = OUT_DIR / f"gpu-{name}.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            figures[f"pipeline_{name}"] = pipeline_run(args, Path(workdir) / name, log=log)
            figures[f"plain_{name}"] = plain.train(compose(args), lean=True, device="cuda")
    rows = []
    for name in PRECISIONS:
        ours, loop = figures[f"pipeline_{name}"], figures[f"plain_{name}"]
        ratio = [round(p / q, 3) for p, q in zip(ours["samples_s"], loop["samples_s"])]
        figures[f"samples_s_ratio_{name}"] = ratio
        rows += [
            (f"pipeline, {name}", *ours["samples_s"], *ours["data_wait_fraction"], ours["val_accuracy"][-1]),
            (f"plain loop, {name}", *loop["samples_s"], *loop["data_wait_fraction"], loop["val_accuracy"][-1]),
            ("pipeline / plain", *(f"{r}x" for r in ratio), *[""] * epochs, ""),
        ]
    header = (
        f"cifar_vit on {figures['device']}",
        *(f"epoch {e + 1} samples/s" for e in range(epochs)),
        *(f"epoch {e + 1} data wait" for e in range(epochs)),
        "val_accuracy",
    )
    print(table(rows, header))
    write("gpu", figures)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
