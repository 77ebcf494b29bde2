"""The training worker's helpers that need no Ray runtime."""

from __future__ import annotations

import threading

import pytest

from pipeline.worker import prefetched


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
