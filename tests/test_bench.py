"""The benchmarks' own parts: the plain loop's baselines train what the config says, and the README's figures are
what bench/all.py writes from docs/figures.json, not typed."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from pipeline.api import compose

BENCH = Path(__file__).resolve().parent.parent / "bench"


def bench_module(name: str):
    """A bench/ script as a module (bench/ on the path, as its scripts run)."""
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "data, transforms",
    [("encoded", "torchvision"), ("decoded", "torchvision"), ("encoded", "pipeline"), ("decoded", "pipeline")],
)
def test_each_plain_baseline_learns_the_configured_task(data_root, data, transforms):
    plain = bench_module("plain")
    cfg = compose(["+experiment=smoke", f"source.root={data_root}", "train.epochs=4", "ingest.batch_size=64"])
    figures = plain.train(cfg, data, transforms)
    assert len(figures["samples_s"]) == 4 and min(figures["samples_s"]) > 0
    assert figures["val_accuracy"][-1] > 0.3, figures  # labels set the brightness; chance is 0.1


def test_the_readme_figures_are_written_from_docs_figures_json():
    written = bench_module("all")
    record = json.loads(written.FIGURES.read_text())
    assert written.readme_table(record) in written.README.read_text()
    assert written.PAGE.read_text() == written.page(record)
