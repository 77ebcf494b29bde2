"""The training worker's helpers that need no Ray runtime."""

from __future__ import annotations

import threading

import pytest
import torch

from pipeline.metrics import epoch_metrics
from pipeline.source import Layout
from pipeline.task import Task
from pipeline.worker import Replica, autocast_settings, evaluate, prefetched, train_epoch


def test_prefetched_asks_for_the_first_batch_before_anyone_iterates():
    asked = threading.Event()

    def batches():
        asked.set()
        yield from range(5)

    stream = prefetched(batches())
    assert asked.wait(timeout=10)  # fetched in the background: the model can be built meanwhile
    assert list(stream) == [0, 1, 2, 3, 4]


def test_prefetched_passes_an_empty_stream_and_errors_through():
    assert list(prefetched(iter(()))) == []

    def failing():
        raise OSError("cannot read part-00003.parquet")
        yield  # a generator

    with pytest.raises(OSError, match="part-00003"):
        list(prefetched(failing()))


@pytest.mark.parametrize(
    "task",
    [
        {"type": "classification", "loss": {"_target_": "torch.nn.CrossEntropyLoss"}, "metrics": ["top2_accuracy"]},
        {"type": "regression", "loss": {"_target_": "torch.nn.MSELoss"}, "metrics": ["mae", "rmse"]},
    ],
)
def test_an_epoch_reports_exactly_the_declared_metrics(task):
    """What train_epoch and evaluate return is what pipeline.metrics declares, so the tracker, which logs
    the declared names, drops nothing and misses nothing (outside a process group: one worker)."""
    torch.manual_seed(0)
    outputs = 3 if task["type"] == "classification" else 1
    model = torch.nn.Linear(4, outputs)
    autocast, scaler = autocast_settings(torch.device("cpu"), {"amp": False, "amp_dtype": "bfloat16"})
    layout = Layout.of({"feature_column": "x", "label_column": "y"})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    replica = Replica(model, optimizer, None, scaler, autocast, Task(task), None, layout)
    labels = torch.tensor([0, 1, 2, 1]) if outputs == 3 else torch.tensor([0.5, 1.0, -1.0, 2.0])
    batches = [{"x": torch.randn(4, 4), "y": labels}] * 3
    cfg = {"tracking": {"log_every_n_steps": 0}}
    metrics = train_epoch(replica, batches, cfg, 0, 0, None) | evaluate(replica, batches)
    assert set(metrics) == set(epoch_metrics(task["type"], task["metrics"]))
    assert metrics["train_rows"] == metrics["val_rows"] == 12 and 0 <= metrics["data_wait_fraction"] < 1
    assert all(value == value for value in metrics.values())  # no NaN
