"""ingest.cache: which steps run once, what the cache holds, how it is sized, and its barrier-free shuffle."""

from __future__ import annotations

import os

import numpy as np
import pyarrow.parquet as pq
import pytest
from conftest import compose_cfg, epoch_dataset, in_block_order, row_groups, write_split
from test_own_data import write_sorted_and_shuffled

from pipeline.common.errors import PipelineError
from pipeline.config import ScalingConfig
from pipeline.data import cache_plan, pieces, preprocess, source, steps
from pipeline.data.pieces import RowGroup
from pipeline.jobs import preflight
from pipeline.runtime.cluster import local_cpus
from transforms import decode_image


def test_deterministic_steps_run_once_and_seeded_augmentation_every_epoch():
    """A step runs every epoch when its function takes the epoch (seeded augmentation), or its ``cache``
    says so; every step after it too. Decoding and resizing run once."""

    def split(overrides: list[str], name: str = "train") -> tuple[list[str], list[str]]:
        once, every_epoch = steps.cached_steps(compose_cfg(overrides).transforms.active(name))
        return list(once), list(every_epoch)

    assert split([]) == (["decode"], ["crop", "flip"])
    assert split(["transforms=imagenet"]) == (["decode"], ["crop"])
    assert split(["transforms=imagenet"], "valid") == (["decode"], [])
    assert split(["transforms.train.decode.cache=false"]) == ([], ["decode", "crop", "flip"])
    assert split(["transforms.train.crop.cache=true"]) == (["decode", "crop"], ["flip"])
    assert split(["transforms=none"]) == ([], [])


def test_a_local_runtime_lets_preprocessing_use_the_cores_training_waits_on():
    """Logical CPUs: the cores, plus what training reserves, plus one (Ray Data's budget is the rest)."""
    cores = os.cpu_count()
    assert local_cpus(compose_cfg(["scaling=cpu"]).scaling) == cores + 1 + 1  # 2 workers x 0.5 CPU
    assert local_cpus(compose_cfg(["+experiment=cifar_vit_cpu"]).scaling) == cores + 1 + 1
    assert local_cpus(ScalingConfig(num_workers=3, resources_per_worker={"CPU": 2, "GPU": 1})) == cores + 6 + 1


def test_the_cache_is_sized_from_the_first_rows_and_refused_when_it_does_not_fit(data_root, ray_runtime):
    """auto caches what fits ingest.cache_share of the object store, streams what does not (and says
    so) and a run of one epoch, which reads each row once; true fails before training with the estimate
    and the settings to change; false never caches."""
    args = [f"source.root={data_root}", "source.download=null", "train.epochs=2"]
    splits = preflight.sources(compose_cfg(args))
    plan = cache_plan.cache_plan(compose_cfg(args), splits)
    assert plan.on
    assert 3 * 32 * 32 + 8 < plan.row_bytes["train"] < 3 * 32 * 32 + 200  # pixels, label and the file's path
    assert plan.estimate_bytes == pytest.approx(512 * plan.row_bytes["train"] + 256 * plan.row_bytes["valid"], abs=1)

    refused = cache_plan.cache_plan(compose_cfg([*args, "ingest.cache_share=1e-9"]), splits)
    assert not refused.on and "not cached, every step runs every epoch (2 MiB estimated, 0 MiB" in refused.summary()
    with pytest.raises(PipelineError, match=r"ingest.cache=true: .*about 2 MiB .*ray.object_store_memory=BYTES"):
        cache_plan.cache_plan(compose_cfg([*args, "ingest.cache=true", "ingest.cache_share=1e-9"]), splits)
    off = cache_plan.cache_plan(compose_cfg([*args, "ingest.cache=false"]), splits)
    assert not off.on and off.summary() == "not cached (ingest.cache=false): every step runs every epoch"
    once = cache_plan.cache_plan(compose_cfg([*args, "train.epochs=1"]), splits)
    assert not once.on and once.summary() == "not cached (ingest.cache=auto): one epoch reads each row once"
    assert cache_plan.cache_plan(compose_cfg([*args, "train.epochs=1", "ingest.cache=true"]), splits).on


def rows_of(ds) -> list[tuple[bytes, int]]:
    """Every row of ``ds`` as (pixel bytes, label), in the order the dataset gives them."""
    return [(np.asarray(row["image"]).tobytes(), int(row["label"])) for row in ds.take_all()]


def test_a_cached_split_holds_the_rows_streaming_gives(tmp_path, ray_runtime):
    """The validation split (decode only) through the cache, read by Ray Data's read tasks (as on a cluster): the same
    pixels as every step run by Ray Data, each row once, in the stored order without a shuffle; the cache reports its
    rows and bytes."""
    write_split(tmp_path / "cifar10" / "train", 8, 1, seed=0)
    write_split(tmp_path / "cifar10" / "test", 96, 3, seed=5)
    cfg = compose_cfg([f"source.root={tmp_path}", "source.download=null"])
    split = source.prepare(cfg.source)["valid"]
    split.steps = cfg.transforms.active("valid")
    streamed = rows_of(preprocess.dataset(split, split.steps, ["image", "label"], cfg.source))
    with in_block_order() as actor:
        cache = preprocess.cached_split(split, row_groups(split), ["image", "label"], None, 3200)
        cached = rows_of(epoch_dataset(cfg, split, actor, built=cache))
    table = pq.read_table(split.files)
    pixels = decode_image({"image": np.array(table["image"].to_pylist(), dtype=object)})["image"]
    stored = [(image.tobytes(), label) for image, label in zip(pixels, table["label"].to_pylist())]
    assert cached == stored and sorted(streamed) == sorted(stored)
    built = cache.figures()
    assert built["rows"] == 96 and 96 * 3072 <= built["bytes"] < 96 * 3300 and built["seconds"] > 0


def epoch_rows(cfg: dict, split: source.Split, epochs: list[int]) -> list[list[tuple[bytes, int]]]:
    """The training split's rows (decoded pixels, label) per epoch, as Ray Data's read tasks read them from a cache
    built anew (as a resumed run builds it)."""
    import ray

    split.steps = {"decode": cfg.transforms.train["decode"]}
    passes = []
    with in_block_order() as actor:
        built = preprocess.cached_split(split, row_groups(split), ["image", "label"], 0, 3200)
        ds = epoch_dataset(cfg, split, actor, seed=0, numbered=True, built=built)
        for epoch in epochs:
            ray.get(actor.set_epoch.remote(epoch))
            passes.append(rows_of(ds))
    return passes


def test_the_cached_shuffle_is_new_each_epoch_and_mixes_a_class_sorted_layout(tmp_path, ray_runtime):
    """No all-to-all pass: each epoch a seeded order of the row groups, and each read task's rows mixed. Every row
    once per epoch; epochs differ; the same epoch repeats from a new cache (a resumed run); and although each file
    holds one class, the first batch holds several."""
    write_sorted_and_shuffled(tmp_path)
    cfg = compose_cfg([f"source.root={tmp_path / 'sorted'}", "source.download=null"])
    split = source.prepare(cfg.source)["train"]
    first, second = epoch_rows(cfg, split, [0, 1])
    (again,) = epoch_rows(cfg, split, [1])
    assert len(first) == 512 and sorted(first) == sorted(second)
    assert first != second and second == again
    # two read tasks (the runtime's 2 CPUs), each of five class files: its rows mixed, a batch holds several classes
    assert len({label for _, label in first[:32]}) >= 4 and len({label for _, label in second[:32]}) >= 4
    assert {label for _, label in first[:256]} != {label for _, label in first[256:]}


class ListedCache:
    """A cache's shape without Ray: ``groups`` row groups of ``rows`` each, one piece a group (its index its ref)."""

    def __init__(self, groups: int, rows: int, seed: int | None):
        self.by_group, self.rows, self.seed = [[g] for g in range(groups)], rows, seed

    def window(self, epoch: int, index: int, count: int):
        groups = pieces.window_groups(len(self.by_group), self.seed, epoch, count)[index]
        return [i for g in groups for i in self.by_group[g]], [[(self.rows, 0)] for _ in groups]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_workers_reading_a_cache_themselves_each_take_an_equal_share_every_row_once(world):
    """pieces.shard, as each worker of an indexed split deals itself its share: every worker the same number of rows
    (the epoch's rows // world), none twice, each from every window (epoch 0's windows follow the cache's build);
    a resumed epoch leaves out the rows trained on and shares the rest the same way; the next epoch another order."""
    source, numbers = (
        ListedCache(groups=40, rows=25, seed=3),
        pieces.row_numbers([RowGroup(file="f", index=g, rows=25, bytes=1) for g in range(40)]),
    )

    def shares(epoch: int, done=None, left: int = 1000) -> list[list[int]]:
        out = []
        for rank in range(world):
            taken, windows = [], 0
            for window, mine in pieces.shard(
                source,
                pieces.Windows(4, 1),
                epoch,
                seed=3,
                numbers=numbers,
                done=done,
                rank=rank,
                world=world,
                rows=left,
            ):
                assert len(mine) >= 1 and len(set(mine)) == len(mine)
                taken, windows = taken + window.numbers[mine].tolist(), windows + 1
            assert windows == (4 if epoch == 0 else 1)  # every worker moves through the windows with the others
            out.append(taken)
        return out

    first = shares(0)
    assert {len(s) for s in first} == {1000 // world} and len({r for s in first for r in s}) == world * (1000 // world)
    assert first != shares(1) and first == shares(0)
    trained = np.zeros(1000, dtype=bool)
    trained[::3] = True  # a stop after a third of the epoch's rows
    resumed = shares(0, np.packbits(trained), left=1000 - trained.sum())
    rows = [r for s in resumed for r in s]
    assert not trained[rows].any() and len(set(rows)) == len(rows) == world * ((1000 - trained.sum()) // world)


def test_a_worker_reading_the_cache_itself_batches_its_share_in_order_copying_each_row_once(monkeypatch):
    """Feed.read: a worker's share, four windows of 3,000 rows dealt from pieces of 1,000, in batches of 7: the
    batches hold the share's rows in the order dealt, each once, with its piece, place and number, and the last two
    rows as a batch of their own; what is copied to make a batch is its own rows (the rest of a window waiting was
    copied at every batch before: quadratic in a worker's share of an epoch)."""
    from types import SimpleNamespace

    from pipeline.data import feed

    windows = [
        pieces.WindowRows(
            refs=[f"w{w}p{i}" for i in range(5)],
            starts=np.arange(0, 5001, 1000),
            order=np.arange(5000),
            numbers=np.arange(5000) + 5000 * w,
        )
        for w in range(4)
    ]
    mine = [np.random.default_rng(w).permutation(5000)[:3000] for w in range(4)]
    monkeypatch.setattr(pieces, "shard", lambda *args, **kwargs: iter(zip(windows, mine)))
    copied = [0]
    concatenate = np.concatenate

    def counted(arrays, *args, **kwargs):
        out = concatenate(arrays, *args, **kwargs)
        copied[0] += out.size
        return out

    monkeypatch.setattr(np, "concatenate", counted)
    worker = SimpleNamespace(
        reading=SimpleNamespace(ingest=SimpleNamespace(batch_size=7)),
        gathered=lambda indexed, held, refs, place, numbers: (list(refs), place, numbers),
    )
    indexed = SimpleNamespace(rows=20_000, cache=SimpleNamespace(windows=None, seed=0), numbers=np.arange(20_000))
    batches = list(feed.Feed.read(worker, indexed, 0, 0, 1, None, False))
    monkeypatch.setattr(np, "concatenate", concatenate)
    refs, places, numbers = (np.concatenate([batch[i] for batch in batches]) for i in range(3))
    assert [len(batch[1]) for batch in batches] == [7] * 1714 + [2]
    expected = np.concatenate([window.numbers[rows] for window, rows in zip(windows, mine)])
    assert numbers.tolist() == expected.tolist()  # every row once, in the order dealt
    assert refs.tolist() == [f"w{n // 5000}p{n % 5000 // 1000}" for n in expected] and (places == expected % 1000).all()
    assert copied[0] <= 3 * 12_000  # refs, places and numbers, each row's once (before: about 3.6 million)


def test_a_feed_whose_caller_stops_early_leaves_no_thread_behind():
    """feed.ahead (a DataLoader's workers and prefetch, in threads): a caller that takes one of two batches and leaves
    (an early stop, an error in its step) lets every thread go; before, the thread drawing the batches waited for ever
    to hand on their end, holding the iterator (a thread and a Ray Data iterator leaked per run in one process)."""
    import threading

    from pipeline.data import feed

    drawn = threading.Event()

    def items():
        yield from range(2)
        drawn.set()

    before = set(threading.enumerate())
    got = feed.ahead(items(), lambda item: item * 10, threads=1)
    assert next(got) == 0
    assert drawn.wait(10)  # the second batch waits in the queue; the end comes next
    got.close()
    left = set(threading.enumerate()) - before
    for thread in left:
        thread.join(timeout=5)
    assert [thread.name for thread in left if thread.is_alive()] == []
