"""The GPU levers on this machine's CPUs: what each costs or saves where it can be measured without a GPU.

- Training runs of ``cifar_vit_cpu`` (ViT 4L/128, 2 workers over gloo) on 5,000 CIFAR-10 rows, 2 epochs, one per
  lever: DDP (the default), ``scaling.strategy=fsdp``, ``train.compile=true``, ``train.activation_checkpointing=true``.
  Per epoch samples/s, and each worker's parameter and optimizer bytes, from the runs' MLflow records.
- The activation memory activation checkpointing saves: the bytes autograd keeps for backward in one forward of
  that ViT on a batch of 64, without and with the blocks recomputed (``torch.autograd.graph.saved_tensors_hooks``).

    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 PIPELINE_DATA_DIR=../shared/data python bench/levers.py

Takes about 8 minutes on 2 cores. Prints two tables and writes outputs/bench/levers.json.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from hydra.utils import instantiate
from report import data_dir, last_run, pipeline_run, table, write

from pipeline.api import compose
from pipeline.training import parallel

RUN = [
    "+experiment=cifar_vit_cpu",
    "source.limit=5000",
    "train.epochs=2",
    "tracking.log_model=false",
    "tracking.register_as=null",
]
LEVERS = {
    "ddp": [],
    "fsdp": ["scaling.strategy=fsdp"],
    "compile": ["train.compile=true"],
    "activation_checkpointing": ["train.activation_checkpointing=true"],
}


def worker_bytes(outputs: Path) -> dict:
    _, run = last_run(outputs)
    return {key: int(run.data.metrics[key]) for key in ("param_bytes", "optimizer_bytes")}


def saved_for_backward(recompute: bool, rows: int = 64) -> int:
    """Bytes autograd keeps from one forward of the experiment's ViT for its backward."""
    model = instantiate(compose(RUN).model)
    if recompute:
        for block in parallel.blocks(model, None):
            parallel.recompute_in_backward(block)
    kept, weights = [], {p.data_ptr() for p in model.parameters()}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.data_ptr() not in weights:  # the weights (and their transposes) are kept anyway
            kept.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(torch.randn(rows, 3, 32, 32)).sum().backward()
    return sum(kept)


def main() -> None:
    data_dir()
    figures: dict = {}
    with tempfile.TemporaryDirectory() as workdir:
        for name, levers in LEVERS.items():
            outputs = Path(workdir) / name
            run = pipeline_run([*RUN, *levers], outputs)
            figures[name] = {**run, **worker_bytes(outputs)}
    base = figures["ddp"]["samples_s"]
    rows = [
        (
            name,
            *f["samples_s"],
            "/".join(f"{s / b:.2f}x" for s, b in zip(f["samples_s"], base)),
            f"{f['param_bytes'] / 1e6:.2f}",
            f"{f['optimizer_bytes'] / 1e6:.2f}",
            f["val_accuracy"][-1],
            f["wall_s"],
        )
        for name, f in figures.items()
    ]
    print(
        table(
            rows,
            (
                "lever",
                "epoch 1 samples/s",
                "epoch 2",
                "vs ddp",
                "param MB/worker",
                "optim MB/worker",
                "val_acc",
                "wall s",
            ),
        )
    )
    plain, recomputed = saved_for_backward(False), saved_for_backward(True)
    figures["activations_mb"] = {"kept": round(plain / 1e6, 1), "recomputed": round(recomputed / 1e6, 1)}
    print(
        table(
            [("ViT 4L/128, batch 64", f"{plain / 1e6:.1f}", f"{recomputed / 1e6:.1f}")],
            ("activations for backward", "MB", "with activation_checkpointing"),
        )
    )
    write("levers", figures)


if __name__ == "__main__":
    main()
