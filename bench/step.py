"""The training step alone, where each side runs it: ``cifar_vit_cpu``'s model, optimizer, batch size and torch
threads on one batch held in memory, (1) in this process without Ray, as the plain loop runs it; (2) in a Ray
task shaped like the pipeline's training worker (one CPU, Ray's worker niceness, ``OMP_NUM_THREADS=1``);
(3) in this process again, with that Ray runtime idle beside it. Whether the pipeline's gap to the plain
loop in training (``bench/train.py``) comes from where its step runs or from what runs beside it
(docs/performance.md, "Where the training gap goes").

    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 python bench/step.py

About two minutes on 2 cores. Prints a table and writes outputs/bench/step.json.
"""

from __future__ import annotations

from pathlib import Path

import ray
import torch
from ingest import model_alone
from report import table, write

from pipeline.api import compose

EXPERIMENT = ["+experiment=cifar_vit_cpu"]


def step_rate() -> int:
    """Samples/s of the experiment's training step on random pixels, the best of 3 x 40 steps."""
    cfg = compose(EXPERIMENT)
    images = torch.rand(cfg.ingest.batch_size, 3, 32, 32)
    labels = torch.randint(0, cfg.source.num_classes, (cfg.ingest.batch_size,))
    return model_alone(cfg, images, labels, steps=40, repeats=3, torch_threads=cfg.scaling.torch_threads)


def main() -> None:
    alone = step_rate()
    # the task imports this directory's modules as the driver does
    ray.init(num_cpus=4, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": str(Path(__file__).parent)}})
    in_ray = ray.get(ray.remote(num_cpus=1)(step_rate).remote())
    beside = step_rate()
    ray.shutdown()
    figures = {
        "plain_process": alone,
        "ray_task": in_ray,
        "plain_process_ray_idle_beside": beside,
        "ray_task_over_plain": round(in_ray / alone, 3),
        "ray_idle_beside_over_plain": round(beside / alone, 3),
    }
    rows = [
        ("plain process", alone, "1.0x"),
        ("Ray task (the training worker's placement)", in_ray, f"{figures['ray_task_over_plain']}x"),
        ("plain process, an idle Ray runtime beside it", beside, f"{figures['ray_idle_beside_over_plain']}x"),
    ]
    print(table(rows, ("cifar_vit_cpu's training step, one batch in memory", "samples/s", "/ plain")))
    write("step", figures)


if __name__ == "__main__":
    main()
