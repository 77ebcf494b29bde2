"""Each epoch of a split as Ray Data's read tasks read it (:mod:`pipeline.data.epochs`): every row once, in a new
seeded order, numbered, a resumed epoch without the rows trained before its stop; the cache the workers read
themselves, whose first epoch trains from the pieces as they are built; and the steps a streamed split skips."""

from __future__ import annotations

import pickle

import numpy as np
import pyarrow.parquet as pq
import pytest
import ray
import torch
from conftest import compose_cfg, epoch_dataset, in_block_order, jpeg, row_groups, write_split

import transforms
from pipeline.common.errors import PipelineError
from pipeline.data import pieces, preprocess, source, steps
from pipeline.data.epochs import ReadCount
from pipeline.data.feed import Collate
from pipeline.jobs import preflight
from transforms.device import RandomResizedCrop
from transforms.randomness import ROW


def row_groups_split(root, files: int, rows: int = 16):
    """``root``'s training split: ``files`` files of one row group each, ``rows`` rows a file."""
    write_split(root / "cifar10" / "train", files * rows, files, seed=3)
    write_split(root / "cifar10" / "test", 16, 1, seed=4)
    cfg = compose_cfg([f"source.root={root}", "source.download=null", "source.limit=null"])
    return cfg, source.prepare(cfg.source)["train"]


def stored_rows(split: source.Split) -> dict[bytes, str]:
    """Each stored image's bytes, with the file it is in."""
    return {image: file for file in split.files for image in pq.read_table(file)["image"].to_pylist()}


def epochs_read(cfg, split: source.Split, epochs: list[int], **options) -> list[list[dict]]:
    """The split's rows per epoch, in block order, as Ray Data's route reads them (seeded with 7)."""
    with in_block_order() as actor:
        ds = epoch_dataset(cfg, split, actor, seed=7, **options)
        out = []
        for epoch in epochs:
            ray.get(actor.set_epoch.remote(epoch))
            out.append(ds.take_all())
        return out


def test_each_epoch_reads_every_row_once_in_a_new_order_each_read_task_mixing_its_run_of_row_groups(
    tmp_path, ray_runtime
):
    """Six row groups read by three tasks (ingest.read_task_mib a third of the split): every row once an epoch, a new
    order each epoch, the same for the same epoch; each task's rows come out together, and they are the rows of the
    two row groups the epoch's order gives it, mixed among themselves."""
    cfg, split = row_groups_split(tmp_path, files=6)
    total = sum(group.bytes for group in row_groups(split))
    first, second, again = epochs_read(cfg, split, [0, 1, 1], task_mib=total / 3 / 2**20)
    stored = stored_rows(split)
    images = [[row["image"] for row in rows] for rows in (first, second, again)]
    assert sorted(images[0]) == sorted(images[1]) == sorted(stored) and images[0] != images[1] == images[2]
    for epoch, rows in ((0, images[0]), (1, images[1])):
        for run, at in zip(np.array_split(pieces.group_order(6, 7, epoch), 3), range(0, 96, 32)):
            # this task's two row groups, all of their rows, mixed: the first half holds rows of both
            assert {stored[image] for image in rows[at : at + 32]} == {split.files[g] for g in run}
            assert len({stored[image] for image in rows[at : at + 16]}) == 2


def test_rows_are_numbered_in_file_order_and_a_resumed_epoch_leaves_out_those_trained_before_the_stop(
    tmp_path, ray_runtime
):
    """The training split's rows carry their number (file order: the ledger's and the draws' key), whatever order an
    epoch reads them in; an epoch set with the rows trained on before a stop reads every other row once, each with its
    own number, and set again without them (a restarted group back at the epoch's start) reads them all; the epoch's
    label reaches the steps, not the batches."""
    cfg, split = row_groups_split(tmp_path, files=4)
    stored = [image for file in split.files for image in pq.read_table(file)["image"].to_pylist()]
    done = np.zeros(64, dtype=bool)
    done[np.random.default_rng(0).choice(64, 40, replace=False)] = True
    with in_block_order() as actor:
        ds = epoch_dataset(cfg, split, actor, seed=7, numbered=True)
        ray.get(actor.set_epoch.remote(2))
        whole = ds.take_all()
        ray.get(actor.set_epoch.remote(2, np.packbits(done)))
        resumed = ds.take_all()
        ray.get(actor.set_epoch.remote(2))  # a restarted group fell back to the checkpoint at the epoch's start
        again = ds.take_all()
    assert sorted(row[ROW] for row in whole) == list(range(64))
    assert all(row["image"] == stored[row[ROW]] for row in whole + resumed)  # each number names its row
    assert sorted(row[ROW] for row in resumed) == np.flatnonzero(~done).tolist()
    assert [row[ROW] for row in again] == [row[ROW] for row in whole]  # every row again, none left out
    assert [row[ROW] for row in resumed] == [row[ROW] for row in whole if not done[row[ROW]]]  # the same order
    assert all(set(row) == {"image", "label", ROW} for row in whole)


def test_with_every_step_in_the_workers_the_read_tasks_hand_on_the_stored_rows_as_they_are(tmp_path, ray_runtime):
    """One node, every per-epoch step in the workers and their shuffle buffers holding the split: each read task hands
    on its row groups' stored rows in their stored order (no mixing copy: the buffers mix), the bytes as stored, each
    row numbered, no column of the epoch; a resumed epoch still leaves out the rows trained before the stop."""
    cfg, split = row_groups_split(tmp_path, files=4)
    stored = [image for file in split.files for image in pq.read_table(file)["image"].to_pylist()]
    done = np.zeros(64, dtype=bool)
    done[::3] = True
    with in_block_order() as actor:
        ds = epoch_dataset(cfg, split, actor, seed=7, numbered=True, bare=True, task_mib=1e-6)
        ray.get(actor.set_epoch.remote(1))
        whole = ds.take_all()
        ray.get(actor.set_epoch.remote(1, np.packbits(done)))
        resumed = ds.take_all()
    numbers = [row[ROW] for row in whole]
    assert sorted(numbers) == list(range(64)) and all(row["image"] == stored[row[ROW]] for row in whole + resumed)
    order = pieces.group_order(4, 7, 1)  # a task a row group, in the epoch's order; its rows as stored
    assert numbers == [16 * group + row for group in order for row in range(16)]
    assert [row[ROW] for row in resumed] == [n for n in numbers if not done[n]]
    assert all(set(row) == {"image", "label", ROW} for row in whole)


def test_the_first_epoch_trains_from_the_cache_as_it_is_built_a_window_at_a_time(tmp_path, ray_runtime):
    """A cache the workers read themselves (:func:`pipeline.data.pieces.shard`): epoch 0 reads 16 row groups in two
    windows of eight, in the order the cache builds them (it waits for the first window, not the whole cache); epoch 1
    is one window: a full shuffle of every row."""
    cfg, split = row_groups_split(tmp_path, files=16, rows=8)
    split.steps = {"decode": cfg.transforms.train["decode"]}
    cache = preprocess.cached_split(split, row_groups(split), ["image", "label"], 5, 3200)
    passes = []
    for epoch in (0, 1):
        share = pieces.shard(cache, cache.windows, epoch, seed=5, numbers=None, done=None, rank=0, world=1, rows=128)
        images = []
        for window, mine in share:
            piece, place = window.where(mine)
            held = ray.get(window.refs)
            images += [held[p]["image"][r].tobytes() for p, r in zip(piece, place)]
        passes.append(images)
    decode = steps.Steps(split.steps, [])
    file_of = {}
    for file in split.files:
        encoded = np.array(pq.read_table(file)["image"].to_pylist(), dtype=object)
        file_of |= {image.tobytes(): file for image in decode({"image": encoded})["image"]}
    assert cache.windows == pieces.Windows(2, 1) and sorted(passes[0]) == sorted(passes[1]) == sorted(file_of)
    built_first = pieces.group_order(16, 5, 0)[:8]  # the cache builds these first: epoch 0's first window
    assert {file_of[image] for image in passes[0][:64]} == {split.files[g] for g in built_first}
    assert len({file_of[image] for image in passes[1][:64]}) > 8 and passes[0] != passes[1]


def photo(height: int, width: int, seed: int) -> bytes:
    return jpeg(np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8))


def test_a_step_that_only_makes_the_caches_working_size_is_skipped_when_the_split_streams(tmp_path, ray_runtime):
    """transforms=imagenet streamed (ingest.cache=false): the working-size decode (streamed: false) does not
    run, and the crop decodes each photo itself, to 224 x 224, in the training workers on one node (the read tasks
    hand on the stored photos); the same step set to run every epoch is an error before anything starts."""
    import pyarrow as pa

    photos = {}
    for name, rows in (("train", 12), ("test", 4)):
        directory = tmp_path / "cifar10" / name
        directory.mkdir(parents=True)
        images = photos[name] = [photo(300 + 17 * i, 260 + 23 * i, i) for i in range(rows)]
        pq.write_table(
            pa.table({"image": images, "label": [i % 10 for i in range(rows)]}), directory / "part-0.parquet"
        )
    args = [f"source.root={tmp_path}", "source.download=null", "transforms=imagenet", "ingest.cache=false"]
    cfg = compose_cfg(args)
    splits = preflight.sources(cfg)
    assert list(steps.streamed_steps(splits["train"].steps)) == ["crop"]
    with preprocess.training_data(cfg, splits) as data:
        assert set(data.datasets) == {"train", "valid"} and not data.caches
        assert list(data.on_device["train"]) == ["crop"]  # one node: the crop runs in the training workers
        rows = data.datasets["train"].take_all()
    assert sorted(row["image"] for row in rows) == sorted(photos["train"])  # the read tasks hand on the stored photos
    # the crop of each encoded photo itself, as the config draws it (a crop cut from the 256 working size differs),
    # for the row of that number (the training split's rows are numbered in file order: the draws' key)
    crop = {k: v for k, v in splits["train"].steps["crop"].fn.items() if k != "_target_"}
    encoded = {"image": np.array(photos["train"], dtype=object), ROW: np.arange(12)}
    expected = transforms.random_resized_crop(encoded, **crop)["image"]
    in_worker = RandomResizedCrop(**crop)
    batch = {"image": np.array([row["image"] for row in rows], dtype=object), ROW: np.array([row[ROW] for row in rows])}
    collated = Collate([in_worker], 0, torch.device("cpu"))(batch)
    cropped = in_worker(collated.batch, collated.params[0])["image"].numpy()
    assert all(np.array_equal(image, expected[number]) for image, number in zip(cropped, batch[ROW]))

    with pytest.raises(PipelineError, match=r"transforms.train.decode.streamed=false skips the step .*\(cache: true\)"):
        preflight.sources(compose_cfg([*args, "transforms.train.decode.cache=false"]))


def test_the_read_figures_hold_a_few_executions_however_many_epochs_and_count_each_task_run_again():
    """The job's count of what was read (kept by its epochs actor for the whole run): a thousand epochs of two splits
    hold no more than five do, and each task Ray ran twice within its execution is counted once as run again."""
    count = ReadCount()
    sizes = {}
    for execution in range(1000):
        for name in ("train", "valid"):
            for index in range(10):
                count.add(f"node{index % 2}", 100, (name, f"e{execution}", index))
            count.add("node0", 100, (name, f"e{execution}", execution % 10))  # a lost node's task rebuilt
        sizes[execution] = len(pickle.dumps(count))
    assert count.again == 2000 and dict(count.by_node) == {"node0": 2000 * 600, "node1": 2000 * 500}
    assert sizes[999] <= sizes[5] * 1.05  # before: every task of every execution, about 200 times as much
