"""A split read as pieces, each epoch gathered a window at a time: the streamed shuffle (ingest.cache off) and
the cache's first epoch, which trains from the pieces as they are built."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest
import ray
from conftest import compose_cfg, in_block_order, jpeg, row_groups, write_split

import transforms
from pipeline.common.errors import PipelineError
from pipeline.data import pieces, preprocess, source, steps, stream
from pipeline.jobs import preflight
from transforms.randomness import ROW


@pytest.mark.parametrize(("tasks", "windows"), [(1, 1), (5, 2), (8, 8), (13, 4), (40, 3)])
def test_the_tasks_of_an_epoch_read_each_window_in_one_run_of_consecutive_tasks(tasks, windows):
    shares = [pieces.task_share(task, tasks, windows) for task in range(tasks)]
    for window in range(windows):
        run = [task for task, (w, _, _) in enumerate(shares) if w == window]
        assert run == list(pieces.window_tasks(window, tasks, windows)) and run  # consecutive, never empty
        assert [shares[task][1:] for task in run] == [(part, len(run)) for part in range(len(run))]


def three_homes(seed: int | None) -> pieces.WindowRows:
    """A window of 6 pieces of 10 rows, two on each of nodes a, b and c, its rows mixed with ``seed``."""
    starts = np.arange(0, 70, 10)
    order = np.arange(60) if seed is None else np.random.default_rng([seed, 0, 0]).permutation(60)
    homes = ["a", "a", "b", "b", "c", "c"]
    key = None if seed is None else [seed, 0, 0]
    return pieces.WindowRows(
        refs=list(range(6)),
        starts=starts,
        order=order,
        numbers=None,
        piece_bytes=np.full(6, 100),
        piece_homes=homes,
        key=key,
    )


@pytest.mark.parametrize("tasks", [3, 4, 7, 12])
def test_a_window_held_on_three_nodes_is_cut_into_parts_each_of_one_node_every_row_once(tasks):
    """Each part gathers rows held on one node only (nothing crosses the network), each node has parts by its rows,
    and together the parts hold every row of the window once, mixed within each node's share."""
    rows = three_homes(seed=4)
    plan = rows.parts(tasks)
    assert len(plan) == tasks and {home for home, _, _ in plan} == {0, 1, 2}
    parts = [rows.part(home, index, count, 3) for home, index, count in plan]
    assert sorted(np.concatenate(parts).tolist()) == list(range(60))
    for (home, _, _), part in zip(plan, parts):
        piece, _ = rows.where(part)
        assert {rows.piece_homes[p] for p in piece} == {rows.homes()[home]}
    first = parts[0]
    assert first.tolist() != sorted(first.tolist())  # mixed among the node's rows
    assert rows.parts(2) == [(0, 0, 2), (0, 1, 2)]  # fewer tasks than nodes: the whole window, as on one node
    assert rows.part(0, 0, 1, 1).tolist() == rows.order.tolist()


@pytest.mark.parametrize("seed", range(5))
def test_each_task_claims_a_part_on_its_own_node_while_one_is_left_each_part_once(seed):
    """Tasks claim parts in any order, from any node (here node c runs none): each part once; a task gets a part of
    its own node while one is left there, its own part where that is one; one that asks again (Ray retried it,
    perhaps elsewhere) gets the same part."""
    rng = np.random.default_rng(seed)
    homes = ["a", "a", "a", "b", "b", "c", "c"]
    claimed: dict[int, int] = {}
    got = {}
    for task in rng.permutation(7).tolist():
        node = str(rng.choice(["a", "b"]))
        left_here = {part for part in range(7) if homes[part] == node} - set(claimed.values())
        got[task] = pieces.claim(claimed, task, node, homes)
        if left_here:
            assert homes[got[task]] == node
        if task in left_here:
            assert got[task] == task
    assert sorted(got.values()) == list(range(7))
    assert all(pieces.claim(claimed, task, "c", homes) == part for task, part in got.items())


def row_groups_split(root, files: int, rows: int = 16):
    """``root``'s training split: ``files`` files of one row group each, ``rows`` rows a file."""
    write_split(root / "cifar10" / "train", files * rows, files, seed=3)
    write_split(root / "cifar10" / "test", 16, 1, seed=4)
    cfg = compose_cfg([f"source.root={root}", "source.download=null", "source.limit=null"])
    return cfg, source.prepare(cfg.source)["train"]


def stored_rows(split: source.Split) -> dict[bytes, str]:
    """Each stored image's bytes, with the file it is in."""
    return {image: file for file in split.files for image in pq.read_table(file)["image"].to_pylist()}


def streamed_epochs(cfg, split: source.Split, epochs: list[int], budget: int) -> tuple[list[list[bytes]], int]:
    """The split's rows (image bytes) per epoch, in block order, as the streamed dataset gives them, and the
    number of windows each epoch is cut into."""
    with in_block_order() as coordinator:
        ds, streamed = preprocess.streamed_dataset(
            split,
            "train",
            row_groups(split),
            ["image", "label"],
            coordinator=coordinator,
            shuffle_seed=7,
            budget=budget,
        )
        out = []
        for epoch in epochs:
            ray.get(coordinator.set_epoch.remote(epoch))
            out.append([row["image"] for row in ds.take_all()])
        return out, streamed.windows.first


def test_a_split_larger_than_its_budget_streams_in_windows_of_row_groups_drawn_at_random(tmp_path, ray_runtime):
    """Every row once an epoch, a new order each epoch; each window's rows, mixed among themselves, come out
    before the next window's, and a window holds the row groups the epoch's order draws for it."""
    cfg, split = row_groups_split(tmp_path, files=6)
    total = sum(group.bytes for group in row_groups(split))
    (first, second), windows = streamed_epochs(cfg, split, [0, 1], budget=-(-total // 3))
    stored = stored_rows(split)
    assert windows == 3 and sorted(first) == sorted(second) == sorted(stored) and first != second
    for epoch, rows in ((0, first), (1, second)):
        for window, at in zip(pieces.window_groups(6, 7, epoch, 3), range(0, 96, 32)):
            # this window's two row groups, all of their rows, mixed: the first half holds rows of both
            assert {stored[image] for image in rows[at : at + 32]} == {split.files[g] for g in window}
            assert len({stored[image] for image in rows[at : at + 16]}) == 2


def test_the_coordinator_reads_ahead_and_lets_a_window_go_once_its_tasks_are_done_with_it(tmp_path, ray_runtime):
    """Asked for a window, the coordinator has it read and the next one with it; it lets a window go once all
    three of its tasks have asked and a window two later is asked for; an epoch left behind goes; a task retried
    after its window went has it read again, for itself, and it goes at the next ask."""
    cfg, split = row_groups_split(tmp_path, files=4)
    coordinator = preprocess.start_coordinator()

    def held() -> list[int]:
        return ray.get(coordinator.holding.remote("train"))

    try:
        plan = stream.Plan(
            groups=row_groups(split),
            filesystem=split.filesystem,
            columns=["image", "label"],
            seed=0,
            windows=4,
            tasks=12,
            where={},
        )
        ray.get(coordinator.prefetch.remote("train", plan))
        assert held() == [0]  # the first window, read at once
        ray.get(coordinator.window.remote("train", plan, 0, 0))
        assert held() == [0, 1]  # and the next, read ahead
        ray.get(coordinator.window.remote("train", plan, 0, 1))
        assert held() == [0, 1, 2]
        ray.get([coordinator.window.remote("train", plan, 0, 0) for _ in range(2)])  # window 0's other two tasks
        assert held() == [0, 1, 2]  # window 0's tasks may still gather from it
        ray.get(coordinator.window.remote("train", plan, 0, 2))
        assert held() == [1, 2, 3]  # two windows on, window 0 went; window 1, one before the newest, stays
        refs, sizes, _ = ray.get(coordinator.window.remote("train", plan, 1, 2))  # epoch 1, window 2: key 6
        assert held() == [2, 3, 6, 7]  # epoch 0's window 1, more than an epoch behind, went
        assert sum(n for size in sizes for n, _ in size) == 16 and len(ray.get(refs[0])) == 16
        refs, sizes, _ = ray.get(coordinator.window.remote("train", plan, 0, 0))  # a retried task of window 0
        assert sum(n for size in sizes for n, _ in size) == 16 and len(ray.get(refs[0])) == 16  # read again for it
        assert held() == [0, 2, 3, 6, 7]
        ray.get(coordinator.window.remote("train", plan, 1, 2))
        assert held() == [2, 3, 6, 7]  # the retried read goes at the next ask
        read, fetched = ray.get(coordinator.reads.remote())
        assert sum(read.values()) > 0 and fetched == {}  # the bytes read, by node; one node fetches from none
    finally:
        ray.kill(coordinator)


def test_the_first_epoch_trains_from_the_cache_as_it_is_built_a_window_at_a_time(tmp_path, ray_runtime):
    """Epoch 0 reads 16 row groups in two windows of eight, in the order the cache builds them (it waits for
    the first window, not the whole cache); epoch 1 is one window: a full shuffle of every row."""
    cfg, split = row_groups_split(tmp_path, files=16, rows=8)
    split.steps = {"decode": cfg.transforms.train["decode"]}
    with in_block_order() as coordinator:
        cache = preprocess.cached_split(split, row_groups(split), ["image", "label"], 5, 3200)
        ds = preprocess.cached_dataset(split, cache, row_groups(split), ["image", "label"], coordinator, name="train")
        passes = []
        for epoch in (0, 1):
            ray.get(coordinator.set_epoch.remote(epoch))
            passes.append([np.asarray(row["image"]).tobytes() for row in ds.take_all()])
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
    run, and the crop decodes each photo itself, to 224 x 224; the same step set to run every epoch is an error
    before anything starts."""
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
        assert set(data.streams) == {"train", "valid"} and not data.caches
        rows = data.datasets["train"].take_all()
    # the crop of each encoded photo itself, as the config draws it (a crop cut from the 256 working size differs),
    # for the row of that number (the training split's rows are numbered in file order: the draws' key)
    crop = {k: v for k, v in splits["train"].steps["crop"].fn.items() if k != "_target_"}
    encoded = {"image": np.array(photos["train"], dtype=object), ROW: np.arange(12)}
    expected = transforms.random_resized_crop(encoded, **crop)["image"]
    assert sorted(np.asarray(row["image"]).tobytes() for row in rows) == sorted(e.tobytes() for e in expected)

    with pytest.raises(PipelineError, match=r"transforms.train.decode.streamed=false skips the step .*\(cache: true\)"):
        preflight.sources(compose_cfg([*args, "transforms.train.decode.cache=false"]))
