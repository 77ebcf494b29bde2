"""``stage=evaluate`` (on the driver): where a trained model errs, from its predictions over a labelled split.

The predictions are ``stage=predict``'s (:mod:`pipeline.jobs.predict` writes and scores them, in a run nested
under the training run); this module reads them back and adds, for classification, the confusion matrix
and each class's precision, recall and F1, and for regression a residual plot, to that run, with a
one-screen summary on the console.
"""

from __future__ import annotations

import logging

import numpy as np
import pyarrow as pa
from mlflow import MlflowClient

from pipeline.common.errors import PipelineError
from pipeline.config import TaskConfig

log = logging.getLogger(__name__)

CONFUSION_ARTIFACT = "confusion_matrix.png"
PER_CLASS_ARTIFACT = "per_class.json"
RESIDUALS_ARTIFACT = "residuals.png"


def per_class(labels: np.ndarray, predicted: np.ndarray, classes: list) -> tuple[np.ndarray, list[dict]]:
    """The confusion matrix (rows: true class, columns: predicted, in ``classes`` order) and each class's
    precision, recall, F1 and support (scikit-learn's); a class never predicted has precision 0, one never
    present recall 0."""
    from sklearn.metrics import confusion_matrix, precision_recall_fscore_support

    matrix = confusion_matrix(labels, predicted, labels=classes)
    scores = precision_recall_fscore_support(labels, predicted, labels=classes, zero_division=0.0)
    rows = [
        {"class": str(name), "precision": float(p), "recall": float(r), "f1": float(f), "support": int(n)}
        for name, p, r, f, n in zip(classes, *scores)
    ]
    return matrix, rows


def report(client: MlflowClient, run_id: str, table: pa.Table, label: str, task: TaskConfig, classes: list) -> dict:
    """Log where the model errs to the prediction run ``run_id``: for classification the confusion matrix
    (``confusion_matrix.png``), ``per_class.json`` and the macro averages as metrics; for regression
    ``residuals.png``. Returns the metrics it logged; the summary goes to the console."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, predicted = table[label].to_numpy(zero_copy_only=False), table["prediction"].to_numpy(zero_copy_only=False)
    if task.type == "regression":
        fig, axis = plt.subplots(figsize=(5, 4))
        axis.scatter(predicted, labels - predicted, s=6, alpha=0.5)
        axis.axhline(0.0, color="black", linewidth=0.8)
        axis.set_xlabel("prediction")
        axis.set_ylabel("label - prediction")
        fig.tight_layout()
        client.log_figure(run_id, fig, RESIDUALS_ARTIFACT)
        plt.close(fig)
        return {}
    unknown = sorted({str(v) for v in labels} - {str(c) for c in classes})
    if unknown:
        raise PipelineError(
            f"stage=evaluate: predict.source has label(s) {', '.join(unknown[:5])} in column {label!r}, which "
            f"the model's classes ({', '.join(map(str, classes[:10]))}) do not hold; evaluate on rows labelled "
            "as its training rows were."
        )
    matrix, rows = per_class(labels, predicted, classes)
    fig, axis = plt.subplots(figsize=(1.5 + 0.5 * len(classes), 1.2 + 0.5 * len(classes)))
    axis.imshow(matrix, cmap="Blues")
    for (i, j), count in np.ndenumerate(matrix):
        axis.text(j, i, str(count), ha="center", va="center", color="white" if count > matrix.max() / 2 else "black")
    names = [str(c) for c in classes]
    axis.set_xticks(range(len(names)), names, rotation=45, ha="right")
    axis.set_yticks(range(len(names)), names)
    axis.set_xlabel("predicted")
    axis.set_ylabel("true")
    fig.tight_layout()
    client.log_figure(run_id, fig, CONFUSION_ARTIFACT)
    plt.close(fig)
    client.log_dict(
        run_id, {"classes": names, "confusion_matrix": matrix.tolist(), "per_class": rows}, PER_CLASS_ARTIFACT
    )
    macro = {f"macro_{key}": float(np.mean([row[key] for row in rows])) for key in ("precision", "recall", "f1")}
    log.info("evaluated %d rows:\n%s", len(labels), summary(rows, matrix, names))
    return macro


def summary(rows: list[dict], matrix: np.ndarray, names: list[str]) -> str:
    """One screen: each class's precision, recall, F1 and support, and the most common confusion."""
    width = max(8, *(len(n) for n in names))
    lines = [f"{'class':<{width}}  precision  recall     f1  support"]
    lines += [
        f"{r['class']:<{width}}  {r['precision']:9.3f}  {r['recall']:6.3f}  {r['f1']:5.3f}  {r['support']:7d}"
        for r in rows
    ]
    off = matrix - np.diag(np.diag(matrix))
    if off.any():
        i, j = np.unravel_index(np.argmax(off), off.shape)
        lines.append(f"most confused: {off[i, j]} row(s) of {names[i]} predicted as {names[j]}")
    return "\n".join(lines)
