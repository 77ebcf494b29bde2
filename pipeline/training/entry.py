"""The training function Ray Train's controller is handed, and how it reaches the worker's loop.

The controller unpickles the function and its ``train_loop_config`` when it starts, before it asks for the
worker group: a function of :mod:`pipeline.training.worker`, or its :class:`~pipeline.training.worker.WorkerJob`,
would import the worker's modules there (torch's distributed stack, the pipeline's config and checkpoints: about 1 s
of a 2-core machine's start-up, on its critical path). This module imports nothing of the pipeline's, and the job
travels as an object ref, which only the workers resolve.
"""

from __future__ import annotations

import ray


def train_loop_per_worker(config: dict) -> None:
    """Run in each worker: :func:`pipeline.training.worker.train_loop_per_worker` with the job ``config`` refers to."""
    from pipeline.training import worker

    worker.train_loop_per_worker({"job": ray.get(config["job"])})
