"""The training worker's helpers that need no Ray runtime."""

from __future__ import annotations

import threading

import pytest

from pipeline.train import started


def test_started_asks_for_the_first_batch_before_anyone_iterates():
    asked = threading.Event()

    def batches():
        asked.set()
        yield from range(5)

    stream = started(batches())
    assert asked.wait(timeout=10)  # fetched in the background: the model can be built meanwhile
    assert list(stream) == [0, 1, 2, 3, 4]


def test_started_passes_an_empty_stream_and_errors_through():
    assert list(started(iter(()))) == []

    def failing():
        raise OSError("cannot read part-00003.parquet")
        yield  # a generator

    with pytest.raises(OSError, match="part-00003"):
        list(started(failing()))
