"""Reads, memory and shuffle on a simulated cluster: a streamed split (``ingest.cache=false``) read from storage
slowed as S3 is, with 1, 2 and 3 CPU-only preprocessing nodes.

Each measurement starts a fresh ``ray.cluster_utils.Cluster`` in its own process: a head node with no CPUs
(the driver, which takes the batches as a training worker would) and N preprocessing nodes, each with its own
CPUs, its own small object store and the label ``node-type=cpu``, to which the split's first step is pinned as
a user pins it. Every read of the parquet files goes through a filesystem that waits ``--latency`` seconds per
request and reads at ``--bandwidth`` bytes/s per stream (S3's first-byte latency and one GET's throughput), and
records the bytes each node read. Per run: rows/s of each epoch and of epochs 2 on together, each preprocessing
node's share of the bytes read, what the cluster spilled to disk (``ray memory --stats-only``).

    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 PIPELINE_DATA_DIR=../shared/data python bench/cluster.py [--nodes 1,3] [--bare]

``--bare`` drops the transform steps: every simulated node decodes on this machine's own cores, which then bound
the figure instead of the reads. The data: CIFAR-10's 50,000 training rows twice over, in row groups of 500 rows
(outputs/bench/data/cluster, written once). About 3 minutes a node count. Prints a table and writes
outputs/bench/cluster.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import pyarrow.fs as pafs
import pyarrow.parquet as pq
from report import bench_env, data_dir, last_run, metric_history, table, write

BENCH = Path(__file__).resolve().parent
# --photos: photos of real sizes (bench/ingest.py's streamed set, 40,000 rows), the ImageNet steps
PHOTOS = [
    f"source.root={BENCH.parent / 'outputs' / 'bench' / 'data'}",
    "source=photos",
    "transforms=imagenet",
    "source.train=${source.root}/photos_streamed/train",
    "source.valid=${source.root}/photos_streamed/valid",
]
DATA = (BENCH.parent / "outputs" / "bench" / "data" / "cluster").resolve()
GROUP_ROWS = 500
EPOCHS = 4
# --bare: no transform step, so that reading is all the work (this machine's 2 cores decode for every
# simulated node); the head has no CPU, so everything still runs on the preprocessing nodes
NO_STEPS = [
    f"transforms.{split}.{step}=null"
    for split, step in (("train", "decode"), ("train", "crop"), ("train", "flip"), ("valid", "decode"))
]


class SlowStorage(pafs.FileSystemHandler):
    """The local filesystem as remote storage: each read request waits ``latency`` s plus its bytes at
    ``bandwidth`` bytes/s, and the bytes each node read are appended to ``ledger`` (a directory)."""

    def __init__(self, latency: float, bandwidth: float, ledger: str):
        self.latency, self.bandwidth, self.ledger = latency, bandwidth, ledger
        self.local = pafs.LocalFileSystem()

    def __eq__(self, other):
        return isinstance(other, SlowStorage) and vars(self) == vars(other)

    def __ne__(self, other):
        return not self == other

    def get_type_name(self):
        return "slow"

    def normalize_path(self, path):
        return path

    def get_file_info(self, paths):
        return self.local.get_file_info(paths)

    def get_file_info_selector(self, selector):
        return self.local.get_file_info(selector)

    def open_input_file(self, path):
        import pyarrow as pa

        return pa.PythonFile(SlowFile(open(path, "rb"), self), mode="r")

    def open_input_stream(self, path):
        return self.open_input_file(path)

    def create_dir(self, *args):
        raise NotImplementedError

    delete_dir = delete_dir_contents = delete_root_dir_contents = delete_file = create_dir
    move = copy_file = open_output_stream = open_append_stream = create_dir


class SlowFile:
    """A file whose every read waits as a remote GET does, and is recorded per node."""

    def __init__(self, file, storage: SlowStorage):
        self.file, self.storage, self.closed = file, storage, False

    def read(self, size=-1):
        data = self.file.read(size)
        time.sleep(self.storage.latency + len(data) / self.storage.bandwidth)
        import ray

        node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else "driver"
        with open(os.path.join(self.storage.ledger, f"{node}-{os.getpid()}"), "a") as ledger:
            ledger.write(f"{len(data)}\n")
        return data

    def seek(self, offset, whence=0):
        return self.file.seek(offset, whence)

    def tell(self):
        return self.file.tell()

    def seekable(self):
        return True

    def readable(self):
        return True

    def writable(self):
        return False

    def close(self):
        self.closed = True
        self.file.close()

    @property
    def size(self):
        return os.fstat(self.file.fileno()).st_size


def prepare() -> Path:
    """CIFAR-10's training rows twice over (100,000 rows, so that an epoch outlasts its fixed costs) in row
    groups of ``GROUP_ROWS`` (20 files), its test rows as they are."""
    target = DATA / "cifar10"
    if not (target / "train").exists():
        rows = pq.read_table(sorted((Path(data_dir()) / "cifar10" / "train").glob("*.parquet")))
        (target / "train").mkdir(parents=True)
        step = rows.num_rows // 10
        for i in range(20):
            part = rows.slice(i % 10 * step, step)
            pq.write_table(part, target / "train" / f"part-{i:02d}.parquet", row_group_size=GROUP_ROWS)
        (target / "test").symlink_to(Path(data_dir()) / "cifar10" / "test")
    return DATA


def spilled(address: str) -> float:
    """MiB the cluster spilled to disk so far (``ray memory --stats-only``)."""
    out = subprocess.run(
        ["ray", "memory", "--stats-only", "--address", address], capture_output=True, text=True, check=True
    ).stdout
    found = re.search(r"Spilled (\d+) MiB", out)
    return float(found.group(1)) if found else 0.0


def one(nodes: int, settings: argparse.Namespace, extra: list[str]) -> dict:
    """One cluster of ``nodes`` preprocessing nodes, as the command line's ``settings`` say (``extra``: config
    overrides): rows/s per epoch, bytes read per node, MiB spilled. ``--lose``: a
    preprocessing node removed halfway through epoch 1 and another added."""
    from ray.cluster_utils import Cluster

    cpus, store, bare, photos, lose = settings.cpus, settings.store, settings.bare, settings.photos, settings.lose
    latency, bandwidth, head_cpus = settings.latency, settings.bandwidth, settings.head_cpus

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": head_cpus, "object_store_memory": store})
    preprocessing = [
        cluster.add_node(num_cpus=cpus, object_store_memory=store, labels={"node-type": "cpu"}) for _ in range(nodes)
    ]
    cluster.wait_for_nodes()
    import ray

    from pipeline.api import compose
    from pipeline.data import preprocess
    from pipeline.jobs import preflight
    from pipeline.runtime import cluster as runtime

    ledger, head = tempfile.mkdtemp(prefix="ledger-"), cluster.head_node.node_id
    try:
        data_set = PHOTOS if photos else [f"source.root={prepare()}"]
        pinned = ["train.decode", "valid.decode", *(["train.crop"] if photos else [])]  # those a streamed split runs
        cfg = compose(
            [
                *data_set,
                "source.download=null",
                "ingest.cache=false",
                *(NO_STEPS if bare else [f"+transforms.{step}.label_selector.node-type=cpu" for step in pinned]),
                f"ray.address={cluster.address}",
                *extra,
            ]
        )
        runtime.connect(runtime.runtime(cfg.ray, cfg.scaling))
        splits = preflight.sources(cfg)
        slow = pafs.PyFileSystem(SlowStorage(latency, bandwidth, ledger))
        for split in splits.values():
            split.filesystem = slow
        rates, seconds, lost = [], [], None
        with preprocess.training_data(cfg, splits) as data:
            for epoch in range(EPOCHS):
                ray.get(data.epochs.set_epoch.remote(epoch))
                start, rows = time.perf_counter(), 0
                for batch in data.datasets["train"].iter_batches(batch_size=None):
                    rows += len(batch["label"])
                    if lose and lost is None and rows >= data.rows["train"] // 2:
                        lost = preprocessing[-1].node_id
                        cluster.remove_node(preprocessing.pop())
                        preprocessing.append(
                            cluster.add_node(num_cpus=cpus, object_store_memory=store, labels={"node-type": "cpu"})
                        )
                seconds.append(time.perf_counter() - start)
                rates.append(round(rows / seconds[-1]))
                assert rows == data.rows["train"], (rows, data.rows["train"])
            reads = data.reads()
        by_node = Counter()
        for name in os.listdir(ledger):
            with open(os.path.join(ledger, name)) as reads:
                by_node[name.rsplit("-", 1)[0]] += sum(int(line) for line in reads)
        total = sum(by_node.values())
        return {
            "rows_s": rates,
            "steady_rows_s": round(data.rows["train"] * (EPOCHS - 1) / sum(seconds[1:])),  # epochs 2 on, together
            # the preprocessing nodes' shares of the bytes read (the head's: the driver's footer reads)
            "read_share": sorted((round(v / total, 3) for k, v in by_node.items() if k != head), reverse=True),
            "read_mib": round(total / 2**20, 1),
            "reads": reads,  # the run's own account: each node's share, the read tasks run again
            "spilled_mib": spilled(cluster.address),
            "rows": data.rows["train"],
        }
    finally:
        ray.shutdown()
        cluster.shutdown()


def trained(nodes: int, settings: argparse.Namespace, extra: list[str]) -> dict:
    """``--train``: the whole pipeline as a user runs it on a cluster of a training head and ``nodes`` preprocessing
    nodes (``--photos``: the real-size photos, streamed, their steps pinned to the preprocessing nodes by label): its
    driver a process of its own, one training worker of one CPU on the head, the probe model. Per epoch: samples/s,
    rows trained and rows trained counted once by their numbers (the ledger); MiB spilled, read per node; with
    ``--lose``, a preprocessing node removed ``--lose-after`` seconds after the first step (in epoch 1) and another
    added."""
    from ray.cluster_utils import Cluster

    os.environ.update(bench_env())  # the nodes' workers import bench/probe.py, as a cluster's image holds a user's code
    store = settings.store
    head = {"num_cpus": settings.head_cpus or 1, "object_store_memory": store, "labels": {"node-type": "train"}}
    cluster = Cluster(initialize_head=True, head_node_args=head)
    preprocessing = [
        cluster.add_node(num_cpus=settings.cpus, object_store_memory=store, labels={"node-type": "cpu"})
        for _ in range(nodes)
    ]
    cluster.wait_for_nodes()
    outputs = Path(tempfile.mkdtemp(prefix="cluster-"))
    pinned = ["train.decode", "train.crop", "valid.decode"] if settings.photos else ["train.decode", "valid.decode"]
    args = [
        "--config-dir",
        str(BENCH / "conf"),
        *(PHOTOS if settings.photos else [f"source.root={prepare()}"]),
        "source.download=null",
        "ingest.cache=false",
        "model=probe",
        *(["model.size=224", "model.stride=8"] if settings.photos else []),
        "scaling.num_workers=1",
        "scaling.resources_per_worker.CPU=1",
        "+scaling.label_selector.node-type=train",
        *(f"+transforms.{step}.label_selector.node-type=cpu" for step in pinned),
        f"train.epochs={settings.epochs}",
        "tracking.log_model=false",
        "tracking.system_metrics_s=null",
        f"ray.address={cluster.address}",
        f"paths.outputs={outputs}",
        f"storage.path={outputs / 'storage'}",
        *extra,
    ]
    env = {**os.environ, **bench_env(), "RAY_ADDRESS": cluster.address}
    lost = None
    try:
        run = subprocess.Popen(
            [sys.executable, "-m", "pipeline", *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        seen, first_step = b"", None
        while run.poll() is None:
            seen += run.stdout.read1(65536) or b""
            if first_step is None and b"start-up: " in seen:  # said at the first training step
                first_step = time.monotonic()
            if settings.lose and lost is None and first_step and time.monotonic() - first_step > settings.lose_after:
                lost = preprocessing[-1].node_id
                cluster.remove_node(preprocessing.pop())
                preprocessing.append(
                    cluster.add_node(num_cpus=settings.cpus, object_store_memory=store, labels={"node-type": "cpu"})
                )
        seen += run.stdout.read()
        if run.returncode:
            raise RuntimeError(seen.decode(errors="replace")[-3000:])
        client, finished = last_run(outputs)
        reads = finished.data.tags.get("pipeline.reads", "")
        return {
            "status": finished.info.status,
            "samples_s": [round(v) for v in metric_history(client, finished, "train_throughput")],
            "train_rows": [int(v) for v in metric_history(client, finished, "train_rows")],
            "train_rows_distinct": [int(v) for v in metric_history(client, finished, "train_rows_distinct")],
            "val_accuracy": [round(v, 4) for v in metric_history(client, finished, "val_accuracy")],
            "read_mib": float(m.group(1).replace(",", "")) if (m := re.match(r"([\d,.]+) MiB read", reads)) else None,
            "reads": reads,
            "spilled_mib": spilled(cluster.address),
            "lost": lost,
        }
    finally:
        cluster.shutdown()


def main(node_counts: list[int], settings: argparse.Namespace, extra: list[str]) -> dict:
    """Each of ``node_counts`` measured by :func:`one` in a process of its own, with this command's arguments."""
    data_dir()
    prepare()
    results = {}
    for nodes in node_counts:
        command = [sys.executable, __file__, *sys.argv[1:], "--one", str(nodes)]
        out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        results[nodes] = json.loads(out.strip().splitlines()[-1])
        print(nodes, results[nodes], flush=True)
    if settings.train:
        write("cluster", {"settings": {**vars(settings), "extra": extra}, "runs": results})
        return results
    base = results[node_counts[0]]["steady_rows_s"]
    rows = [
        (
            f"{nodes} node(s) x {settings.cpus} CPUs",
            *(f"{r:,}" for r in got["rows_s"]),
            f"{got['steady_rows_s']:,}",
            f"{got['steady_rows_s'] / base:.2f}x",
            " / ".join(f"{s:.0%}" for s in got["read_share"]),
            f"{got['spilled_mib']:,.0f}",
        )
        for nodes, got in results.items()
    ]
    header = (
        "preprocessing nodes",
        *(f"rows/s, epoch {e + 1}" for e in range(EPOCHS)),
        f"epochs 2-{EPOCHS}",
        "vs first",
        "reads per node",
        "spilled MiB",
    )
    print(table(rows, header))
    figures = {"settings": {**vars(settings), "extra": extra}}
    write("cluster", figures | {"runs": results})
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="A streamed split on a simulated cluster with slowed reads.")
    parser.add_argument("--nodes", default="1,2,3", help="comma-separated preprocessing node counts")
    parser.add_argument("--cpus", type=int, default=2, help="CPUs per preprocessing node")
    parser.add_argument("--store", type=int, default=80 * 2**20, help="object store bytes per node")
    parser.add_argument("--latency", type=float, default=0.6, help="seconds each read request waits")
    parser.add_argument("--bandwidth", type=float, default=50e6, help="bytes/s of one read stream")
    parser.add_argument("--bare", action="store_true", help="no transform step: reading is all the work")
    parser.add_argument("--head-cpus", type=int, default=0, help="CPUs of the head (the driver's node)")
    parser.add_argument("--photos", action="store_true", help="real-size photos and the ImageNet steps")
    parser.add_argument("--lose", action="store_true", help="lose a preprocessing node halfway through epoch 1")
    parser.add_argument("--train", action="store_true", help="the whole pipeline, training on the head")
    parser.add_argument("--epochs", type=int, default=2, help="with --train: epochs")
    parser.add_argument(
        "--lose-after", type=float, default=8.0, help="with --train --lose: seconds after the first step"
    )
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # one measurement, in this process
    arguments, rest = parser.parse_known_args()
    if arguments.one is not None and arguments.train:
        print(json.dumps(trained(arguments.one, arguments, rest)))
    elif arguments.one is not None:
        print(json.dumps(one(arguments.one, arguments, rest)))
    else:
        main([int(n) for n in arguments.nodes.split(",")], arguments, rest)
