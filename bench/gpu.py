"""The flagship on a GPU: ``+experiment=cifar_vit`` (ViT-12L/384, global batch 512, one GPU worker over nccl)
against the plain PyTorch loop with the same recipe on the same GPU, side by side in one session:

- float32, and bfloat16 autocast (``train.amp=true``), each against the plain loop; bfloat16 over ``SEEDS`` seeds,
  so its accuracy against the plain loop's is a comparison of means, not of single runs;
- the GPU levers on top of bfloat16: ``train.compile=true``, and ``scaling.strategy=fsdp`` (FSDP2 with a world
  size of 1: the sharded code path and its mixed-precision policy on one GPU).

Per epoch: samples/s, data_wait_fraction (the share of the training loop spent waiting for its next batch: is the
GPU fed?) and val_accuracy.

    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 PIPELINE_DATA_DIR=/path/with/cifar10 python bench/gpu.py [EPOCHS] [SEEDS]

The plain loop's DataLoader has a worker per core (``bench/plain.py``). Prints a table and writes
outputs/bench/gpu.json; each pipeline command's console goes to outputs/bench/gpu-<name>.log.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

import plain
import torch
from report import OUT_DIR, data_dir, pipeline_run, table, write

from pipeline.api import compose

EXPERIMENT = ["+experiment=cifar_vit"]
BF16 = ["train.amp=true", "train.amp_dtype=bfloat16"]
# name: (overrides, whether the plain loop runs it too)
VARIANTS = {
    "float32": ([], True),
    "bfloat16": (BF16, True),
    "bfloat16_compile": ([*BF16, "train.compile=true"], False),
    "bfloat16_fsdp": ([*BF16, "scaling.strategy=fsdp"], False),
}


def main(epochs: int, seeds: int) -> None:
    data_dir()
    settings = [f"train.epochs={epochs}", "tracking.log_model=false"]  # export is after training: not timed here
    figures: dict = {"device": torch.cuda.get_device_name(0), "epochs": epochs}
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        for name, (levers, with_plain) in VARIANTS.items():
            for seed in range(seeds if name == "bfloat16" else 1):
                run = f"{name}_seed{seed}"
                args = [*EXPERIMENT, *settings, *levers, f"train.seed={seed}"]
                log = OUT_DIR / f"gpu-{run}.log"
                log.parent.mkdir(parents=True, exist_ok=True)
                ours = figures[f"pipeline_{run}"] = pipeline_run(args, Path(workdir) / run, log=log)
                rows.append(
                    (f"pipeline, {run}", *ours["samples_s"], *ours["data_wait_fraction"], ours["val_accuracy"][-1])
                )
                if with_plain:
                    loop = figures[f"plain_{run}"] = plain.train(compose(args), lean=True, device="cuda")
                    rows.append(
                        (
                            f"plain loop, {run}",
                            *loop["samples_s"],
                            *loop["data_wait_fraction"],
                            loop["val_accuracy"][-1],
                        )
                    )
                    ratio = [round(p / q, 3) for p, q in zip(ours["samples_s"], loop["samples_s"])]
                    rows.append(("pipeline / plain", *(f"{r}x" for r in ratio), *[""] * epochs, ""))
    for who in ("pipeline", "plain"):
        finals = [figures[f"{who}_bfloat16_seed{s}"]["val_accuracy"][-1] for s in range(seeds)]
        figures[f"{who}_bfloat16_val_accuracy_mean"] = round(statistics.mean(finals), 4)
        rows.append(
            (f"{who}, bfloat16: mean over {seeds} seeds", *[""] * (2 * epochs), round(statistics.mean(finals), 4))
        )
    header = (
        f"cifar_vit on {figures['device']}",
        *(f"epoch {e + 1} samples/s" for e in range(epochs)),
        *(f"epoch {e + 1} data wait" for e in range(epochs)),
        "val_accuracy",
    )
    print(table(rows, header))
    write("gpu", figures)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3, int(sys.argv[2]) if len(sys.argv) > 2 else 3)
