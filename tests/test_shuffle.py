"""How well an epoch mixes a split: the bound its read tasks set (from the parquet footers' label ranges), the warning
before training when a split looks sorted, the ``label_mix`` each epoch measures, and the remedy,
``python -m pipeline.reshuffle``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
import torch
from conftest import compose_cfg, write_split
from mlflow import MlflowClient
from test_pipeline import cli_env, run_cli

from pipeline.config import Layout
from pipeline.data import mixing, pieces, source
from pipeline.training.telemetry import EpochTelemetry

CLASSES = list(range(10))


def stored(root: Path, order: str, group_rows: int = 32) -> Path:
    """``root/<order>/cifar10``: 64 rows of each of 10 labels stored by label (a file per label) or shuffled, in row
    groups of ``group_rows``; a test split as it comes."""
    write_split(root / "rows", 1000, 1, seed=1)
    table = pq.read_table(root / "rows")
    by_label = np.concatenate([np.flatnonzero(table["label"].to_numpy() == label)[:64] for label in CLASSES])
    train = root / order / "cifar10" / "train"
    train.mkdir(parents=True)
    if order == "sorted":
        for label, rows in enumerate(np.split(by_label, 10)):
            pq.write_table(table.take(rows), train / f"part-{label:02d}.parquet", row_group_size=group_rows)
    else:
        rows = np.random.default_rng(0).permutation(by_label)
        pq.write_table(table.take(rows), train / "part-00.parquet", row_group_size=group_rows)
    write_split(root / order / "cifar10" / "test", 64, 1, seed=2)
    return root / order


def groups_of(root: Path) -> list[pieces.RowGroup]:
    split = source.prepare(compose_cfg([f"source.root={root}", "source.download=null"]).source)["train"]
    return pieces.row_groups(split.files, split.filesystem, None, "label")


def test_read_tasks_of_a_class_sorted_split_hold_few_labels_and_the_run_is_warned(tmp_path):
    """Twenty read tasks of one row group each: stored by class, each holds one label of ten; stored shuffled, all ten.
    One task of every row group mixes either fully, as does a shuffle buffer of the whole split; one of a quarter of
    it, at most half the labels. Read unshuffled, the advice is to shuffle."""
    cfg = compose_cfg([])
    layout = Layout.of(cfg.source)
    sorted_groups, shuffled_groups = groups_of(stored(tmp_path, "sorted")), groups_of(stored(tmp_path, "shuffled"))
    assert len(sorted_groups) == len(shuffled_groups) == 20 and sorted_groups[0].labels == (0, 0)

    coarse = mixing.mixing(sorted_groups, 20, 0, layout, cfg)
    assert coarse.share == pytest.approx(0.1) and coarse.groups == (1, 1)
    assert "looks sorted by label and is read in 20 read task(s) of 1 row groups" in coarse.warning()
    assert "python -m pipeline.reshuffle SOURCE TARGET" in coarse.warning()
    assert mixing.mixing(shuffled_groups, 20, 0, layout, cfg).share > 0.95  # a group of 32 may miss 0 or 9
    assert mixing.mixing(shuffled_groups, 20, 0, layout, cfg).warning() is None
    assert mixing.mixing(sorted_groups, 1, 0, layout, cfg).warning() is None  # one task: a full shuffle
    # each worker's shuffle buffer draws on the rows of the tasks it spans: the whole split's, a full shuffle
    workers = cfg.scaling.max_workers  # each a buffer of its own
    whole = mixing.mixing(sorted_groups, 20, 0, layout, cfg, buffer=640 // workers)
    assert whole.share == 1.0 and whole.warning() is None
    assert f"a shuffle buffer of {640 // workers} rows, the whole split: a full shuffle" in whole.summary()
    quarter = mixing.mixing(sorted_groups, 20, 0, layout, cfg, buffer=160 // workers)  # 5 tasks' rows: <= 5 labels
    assert 0.3 <= quarter.share <= 0.5 and "ingest.local_shuffle_buffer_size" in quarter.warning()
    unshuffled = mixing.mixing(sorted_groups, 1, None, layout, cfg)  # each row group a task of its own
    assert "Turn the shuffle on: ingest.shuffle=true." in unshuffled.warning()

    regression = compose_cfg(["task=regression"])
    share = mixing.mixing(sorted_groups, 20, 0, layout, regression).share  # a number's range: lengths, not counts
    assert share == 0.0  # each group one value: no length of the range at all


def test_the_auto_shuffle_buffer_is_a_few_batches_of_rows_stored_mixed_and_the_most_of_rows_stored_by_class(tmp_path):
    """Stored shuffled, every row group holds every label: a buffer of FEWEST_BATCHES batches mixes as the whole split
    does, and an epoch's first batch waits for no more rows; stored by class, nothing short of the most the store
    allows (here the whole split) mixes as it does. Where the buffers mix as a full shuffle, the read tasks need not
    (they hand on their rows as stored)."""
    cfg = compose_cfg(["ingest.batch_size=16"])
    layout, workers = Layout.of(cfg.source), cfg.scaling.max_workers
    most = 640 // workers
    fewest = mixing.FEWEST_BATCHES * (16 // workers)
    assert fewest < most
    mixed, by_class = stored(tmp_path / "a", "shuffled"), stored(tmp_path / "b", "sorted")
    assert mixing.enough_rows(most, groups_of(mixed), layout, cfg) == fewest
    assert mixing.enough_rows(most, groups_of(by_class), layout, cfg) == most
    split = lambda root: source.prepare(compose_cfg([f"source.root={root}", "source.download=null"]).source)["train"]  # noqa: E731
    assert mixing.buffers_mix(groups_of(mixed), split(mixed), fewest, cfg)
    assert not mixing.buffers_mix(groups_of(by_class), split(by_class), fewest, cfg)
    assert mixing.buffers_mix(groups_of(by_class), split(by_class), most, cfg)  # the whole split
    assert not mixing.buffers_mix(groups_of(mixed), split(mixed), None, cfg)


def test_label_mix_is_labels_per_batch_against_a_full_shuffles():
    """Ten batches of 32 rows: each of one label (a split read in class order) measures about 1/9.7, where a full
    shuffle holds 9.66 of 10 labels a batch; batches drawn at random measure about 1."""
    generator = torch.Generator().manual_seed(0)
    one_label, drawn = EpochTelemetry(torch.device("cpu"), 10), EpochTelemetry(torch.device("cpu"), 10)
    for label in range(10):
        for telemetry, labels in (
            (one_label, torch.full((32,), label)),
            (drawn, torch.randint(0, 10, (32,), generator=generator)),
        ):
            telemetry.batch(1, torch.tensor(1.0), 32)
            telemetry.batch_labels(labels)
    assert one_label.totals()["label_mix"] == pytest.approx(1 / (10 * (1 - 0.9**32)), rel=1e-6)
    assert 0.9 < drawn.totals()["label_mix"] < 1.1
    assert "label_mix" not in EpochTelemetry(torch.device("cpu")).totals()  # a regression has no labels to mix


def reshuffle(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "pipeline.reshuffle", *args]
    return subprocess.run(command, cwd=cwd, env=cli_env(cwd), capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # starts Ray
def test_reshuffle_rewrites_a_class_sorted_split_that_its_read_tasks_then_mix(tmp_path):
    """The remedy the warning names: every row once, in random order, in row groups of the size asked, after which
    twenty read tasks of the split hold nearly all labels each; an existing target or a missing source is one line."""
    source_dir = stored(tmp_path, "sorted") / "cifar10" / "train"
    target = tmp_path / "rewritten" / "cifar10" / "train"
    result = reshuffle(tmp_path, str(source_dir), str(target), "--rows-per-group", "32", "--rows-per-file", "320")
    assert result.returncode == 0, result.stderr
    before, after = pq.read_table(source_dir), pq.read_table(target)
    rows = lambda table: sorted(zip(table["image"].to_pylist(), table["label"].to_pylist()))  # noqa: E731
    assert rows(after) == rows(before)
    assert after["label"].to_pylist() != before["label"].to_pylist()
    local = pafs.LocalFileSystem()
    groups = pieces.row_groups(source.parquet_files(local, str(target)), local, None, "label")
    assert {group.rows for group in groups} == {32} and len(groups) == 20
    assert pieces.mix(groups, 20, 0, CLASSES) > 0.9

    again = reshuffle(tmp_path, str(source_dir), str(target))
    assert again.returncode == 1 and f"TARGET: {target} exists already" in again.stderr
    missing = reshuffle(tmp_path, str(tmp_path / "nothing"), str(tmp_path / "other"))
    assert missing.returncode == 1 and "SOURCE: no parquet files at" in missing.stderr
    assert "Traceback" not in again.stderr + missing.stderr and not (tmp_path / "other").exists()


@pytest.mark.slow  # starts Ray
def test_a_run_streaming_a_class_sorted_split_in_small_read_tasks_mixes_it_as_a_full_shuffle(tmp_path):
    """Streamed by read tasks of one row group each (a tiny ingest.read_task_mib), a class-sorted split, with the
    default shuffle buffer: no warning, the run records how it mixes (pipeline.shuffle: the whole split in the
    workers' buffers) and measures a label_mix near a full shuffle's 1 (each task's rows alone: about 1/10); on one
    node the per-epoch crop and flip run in the workers, on the rows as the read tasks decode them. Eight tasks a
    label: however the 80 tasks are dealt to the two workers (by arrival), each worker holds nearly every label (of two
    tasks a label, a random deal gives each worker about 7.6 labels: a label_mix of 0.8)."""
    root = stored(tmp_path, "sorted", group_rows=8).parent
    args = ["+experiment=smoke", "ingest.cache=false", "ingest.shuffle=true", "ingest.read_task_mib=1e-6"]
    args.append("scaling.num_workers=2")  # batches of 64 a worker: eight read tasks' rows, each of one class
    result = run_cli([*args, f"source.root={root / 'sorted'}", "source.download=null"], tmp_path, root)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert "looks sorted by label" not in output
    client = MlflowClient(f"sqlite:///{tmp_path / 'outputs' / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("smoke").experiment_id])
    shuffle = run.data.tags["pipeline.shuffle"]
    assert shuffle.startswith("80 read task(s) of 1 row groups of about 8 rows") and "a full shuffle" in shuffle
    assert run.data.metrics["label_mix"] > 0.85
    assert run.data.tags["pipeline.device_steps"] == "train: crop, flip"  # one node: in the workers' feed threads
