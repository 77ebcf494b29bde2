"""The task a model learns (runs in the training workers and the prediction replicas): its loss, its
validation metrics and what a prediction is, as ``task`` declares them (conf/task/, TaskConfig).

Every metric is a sum over rows divided by the row count (``rmse`` takes a square root at the end),
so workers add up their shards' sums and every world size reports the same numbers.
"""

from __future__ import annotations

import math
import re

import numpy as np
import torch
from hydra.utils import instantiate


class Task:
    def __init__(self, task: dict):
        self.regression = task["type"] == "regression"
        self.metrics = list(task["metrics"])
        self.loss_fn = instantiate(task["loss"], _convert_="all")

    def outputs(self, outputs: torch.Tensor) -> torch.Tensor:
        """Regression models may output (N, 1): one number per row either way."""
        return outputs.squeeze(-1).float() if self.regression else outputs

    def targets(self, labels: torch.Tensor) -> torch.Tensor:
        return labels.float() if self.regression else labels.long()

    def loss(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The batch's mean loss."""
        return self.loss_fn(self.outputs(outputs), self.targets(labels))

    def sums(self, outputs: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each metric's sum over the batch (kept on the device)."""
        outputs, labels = self.outputs(outputs).float(), self.targets(labels)
        return {name: metric_sum(name, outputs, labels) for name in self.metrics}

    def predict(self, outputs: torch.Tensor) -> dict[str, np.ndarray]:
        """What a prediction is: the class and its softmax probability, or the number."""
        outputs = self.outputs(outputs).float()
        if self.regression:
            return {"prediction": outputs.cpu().numpy()}
        confidence, prediction = torch.softmax(outputs, dim=1).max(dim=1)
        return {"prediction": prediction.cpu().numpy(), "confidence": confidence.cpu().numpy()}


def metric_sum(name: str, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    if name == "mae":
        return (outputs - labels).abs().sum()
    if name in ("mse", "rmse"):
        return ((outputs - labels) ** 2).sum()
    k = int(re.fullmatch(r"top(\d+)_accuracy", name).group(1)) if name != "accuracy" else 1
    top = outputs.topk(min(k, outputs.shape[1]), dim=1).indices
    return (top == labels[:, None]).any(dim=1).sum()


def finish(name: str, total: float, count: int) -> float:
    """A metric's value from its sum over ``count`` rows."""
    mean = total / max(count, 1)
    return math.sqrt(mean) if name == "rmse" else mean


def prediction_metrics(metrics: list[str], predicted: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """The task's metrics over written predictions (top-k needs scores a prediction file does not keep)."""
    outputs, targets = torch.from_numpy(np.array(predicted)), torch.from_numpy(np.array(labels))
    found = {}
    for name in metrics:
        if name.startswith("top"):
            continue
        if name == "accuracy":
            found[name] = float((outputs == targets).float().mean())
        else:
            found[name] = finish(name, float(metric_sum(name, outputs.float(), targets.float())), len(targets))
    return found
