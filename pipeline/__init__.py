"""Declarative experiment pipeline: Hydra configs -> Ray Data -> Ray Train (DDP) -> MLflow."""
