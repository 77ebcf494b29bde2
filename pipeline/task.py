"""The task a model learns (runs in the training workers and the prediction replicas): its loss, its
validation metrics and what a prediction is, as ``task`` declares them (conf/task/, TaskConfig).
How each metric sums and finishes is declared in :mod:`pipeline.metrics`.
"""

from __future__ import annotations

import numpy as np
import torch
from hydra.utils import instantiate

from pipeline.metrics import Metric, task_metric


class Task:
    def __init__(self, task: dict):
        self.regression = task["type"] == "regression"
        self.metrics: dict[str, Metric] = {name: task_metric(task["type"], name) for name in task["metrics"]}
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
        return {name: metric.batch_sum(outputs, labels) for name, metric in self.metrics.items()}

    def predict(self, outputs: torch.Tensor) -> dict[str, np.ndarray]:
        """What a prediction is: the class and its softmax probability, or the number."""
        outputs = self.outputs(outputs).float()
        if self.regression:
            return {"prediction": outputs.cpu().numpy()}
        confidence, prediction = torch.softmax(outputs, dim=1).max(dim=1)
        return {"prediction": prediction.cpu().numpy(), "confidence": confidence.cpu().numpy()}


def prediction_metrics(task: dict, predicted: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """The task's metrics over written predictions: accuracy from the predicted classes, the errors from
    the predicted numbers (top-k needs scores a prediction file does not keep)."""
    outputs, targets = torch.from_numpy(np.array(predicted)), torch.from_numpy(np.array(labels))
    found = {}
    for name in task["metrics"]:
        if name == "accuracy":
            found[name] = float((outputs == targets).float().mean())
        elif task["type"] == "regression":
            metric = task_metric(task["type"], name)
            found[name] = metric.value(float(metric.batch_sum(outputs.float(), targets.float())), len(targets))
    return found
