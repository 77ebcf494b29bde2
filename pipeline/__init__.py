"""Declarative experiment pipeline: Hydra configs -> Ray Data -> Ray Train (DDP or FSDP2) -> MLflow.

From Python: ``pipeline.train("cifar_vit_cpu", overrides=["optim.lr=1e-3"])``, then ``pipeline.predict(model)`` and
``pipeline.evaluate(model)`` with the run's model (:mod:`pipeline.api`).
"""

import time

# When this interpreter first imported the pipeline: for ``python -m pipeline``, the command's start
# (every import after it included). The process's own start time is no clock for this: a shell that
# runs ``setup && python -m pipeline`` may exec python in its own process, started long before.
STARTED_AT = time.time()


def train(experiment: str | None = None, overrides=(), run_dir: str | None = None):
    """One training run from Python, as the command line runs it: see :func:`pipeline.api.train`."""
    from pipeline.api import train as train_run  # Hydra, torch and Ray load on the first call, not on import

    return train_run(experiment, overrides, run_dir)


def predict(model: str, source=None, *, overrides=(), run_dir: str | None = None):
    """A model's predictions as a pandas DataFrame, as ``stage=predict`` makes them (:func:`pipeline.api.predict`)."""
    from pipeline.api import predict as predicted

    return predicted(model, source, overrides=overrides, run_dir=run_dir)


def evaluate(model: str, source=None, *, overrides=(), run_dir: str | None = None):
    """A model scored as ``stage=evaluate`` scores it: see :func:`pipeline.api.evaluate`."""
    from pipeline.api import evaluate as evaluated

    return evaluated(model, source, overrides=overrides, run_dir=run_dir)
