"""The task a model learns (runs in the training workers and the prediction replicas): its loss, its
validation metrics and what a prediction is, as ``task`` declares them (conf/task/, TaskConfig).
How each metric sums and finishes is declared in :mod:`pipeline.common.metrics`.
"""

from __future__ import annotations

import numpy as np
import torch
from hydra.utils import instantiate

from pipeline.common.metrics import Metric, lower_is_better, task_metric
from pipeline.config import TaskConfig, TaskType


class Task:
    def __init__(self, task: TaskConfig):
        self.regression = task.type == TaskType.regression
        self.metrics: dict[str, Metric] = {name: task_metric(task.type, name) for name in task.metrics}
        self.loss_fn = instantiate(task.loss, _convert_="all")

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


def prediction_metrics(kind: TaskType, names: list[str], predicted: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """The metrics ``names`` of a ``kind`` task (``task.type``, ``task.metrics``) over written predictions:
    accuracy from the predicted classes, the errors from the predicted numbers (top-k needs scores a
    prediction file does not keep)."""
    found = {}
    for name in names:
        if name == "accuracy":  # classes as numbers or names
            found[name] = float(np.mean(np.asarray(predicted) == np.asarray(labels)))
        elif kind == TaskType.regression:
            metric = task_metric(kind, name)
            outputs, targets = torch.from_numpy(np.array(predicted)).float(), torch.from_numpy(np.array(labels)).float()
            found[name] = metric.value(float(metric.batch_sum(outputs, targets)), len(targets))
    return found


def constant_baseline(kind: TaskType, names: list[str], labels: np.ndarray) -> dict[str, float]:
    """What a model that learned nothing at best scores on validation ``labels``, by metric
    (``val_<name>``): always their most common class (classification), or always their mean (regression)."""
    if kind == TaskType.regression:
        constant = np.full(len(labels), float(np.mean(labels)))
    else:
        classes, counts = np.unique(labels, return_counts=True)
        constant = np.full(len(labels), classes[np.argmax(counts)])
    return {f"val_{name}": value for name, value in prediction_metrics(kind, names, constant, labels).items()}


def no_learning(kind: TaskType, names: list[str], last: dict, baseline: dict[str, float]) -> str | None:
    """Why the last epoch's validation is no better than ``baseline`` (:func:`constant_baseline`), or None."""
    for metric, constant in baseline.items():
        value, lower = last[metric], lower_is_better(kind, names, metric)
        if (value >= constant) if lower else (value <= constant):
            predictor = "mean" if kind == TaskType.regression else "most common class"
            return (
                f"{metric} {value:.4g} is no better than always predicting the validation split's {predictor} "
                f"({constant:.4g} on validation): the model learned nothing usable. Check the labels, optim.lr "
                "and train.epochs."
            )
    return None
