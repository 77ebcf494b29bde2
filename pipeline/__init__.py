"""Declarative experiment pipeline: Hydra configs -> Ray Data -> Ray Train (DDP) -> MLflow."""

import time

# When this interpreter first imported the pipeline: for ``python -m pipeline``, the command's start
# (every import after it included). The process's own start time is no clock for this: a shell that
# runs ``setup && python -m pipeline`` may exec python in its own process, started long before.
STARTED_AT = time.time()
