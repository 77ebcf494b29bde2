"""Source stage: find the parquet files of each split, check them on the driver, read them lazily.

Checks read only parquet footers, so a missing path or column fails in milliseconds, before Ray
starts a worker.
"""
from __future__ import annotations

import glob
import io
import os
import tarfile
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.config import PipelineError

SPLITS = ("train", "valid")
CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"


def parquet_files(path: str) -> list[str]:
    """The parquet files a split path names: a file, a directory (searched recursively) or a glob."""
    if glob.has_magic(path):
        files = sorted(glob.glob(path, recursive=True))
    elif os.path.isdir(path):
        files = sorted(str(p) for p in Path(path).rglob("*.parquet"))
    elif os.path.isfile(path):
        files = [path]
    else:
        files = []
    return [os.path.abspath(f) for f in files if os.path.isfile(f)]


def check_split(split: str, path: str, columns: list[str]) -> tuple[list[str], int]:
    """Return the split's files and total row count, or fail naming the path, file or column."""
    files = parquet_files(path)
    if not files:
        raise PipelineError(
            f"source.{split}: no parquet files at {path!r} (resolved to {os.path.abspath(path)!r}). "
            "Set PIPELINE_DATA_DIR to the directory that holds the data (for CIFAR-10 it must contain "
            f"cifar10/train and cifar10/test), or set source.root / source.{split} to a directory, file or glob."
        )
    rows = 0
    for file in files:
        try:
            meta = pq.read_metadata(file)
            schema = pq.read_schema(file)
        except (pa.ArrowInvalid, OSError) as err:
            raise PipelineError(f"source.{split}: {file} is not a readable parquet file ({err}).") from err
        missing = [c for c in columns if c not in schema.names]
        if missing:
            raise PipelineError(
                f"source.{split}: {file} has no column {', '.join(map(repr, missing))} "
                f"(it has {', '.join(schema.names)}). Set source.feature_column / source.label_column."
            )
        rows += meta.num_rows
    return files, rows


def prepare(source: dict) -> dict[str, tuple[list[str], int]]:
    """Resolve and check every split, downloading the data first when it is missing and allowed.

    Returns ``{split: (files, rows)}`` with ``rows`` already capped by ``source.limit``.
    """
    columns = [source["feature_column"], source["label_column"]]
    if source["download"] is not None and not all(parquet_files(source[s]) for s in SPLITS):
        from hydra.utils import instantiate

        download = instantiate(source["download"], _partial_=True)  # called here so its errors stay ours
        download(root=source["root"])
    checked = {split: check_split(split, source[split], columns) for split in SPLITS}
    limit = source["limit"]
    return {s: (files, rows if limit is None else min(rows, limit)) for s, (files, rows) in checked.items()}


def read(files: list[str], limit: int | None, columns: list[str], reader_v2: bool):
    """A lazy Ray Dataset over the files (nothing is read until a worker iterates)."""
    import ray.data

    ray.data.DataContext.get_current().use_datasource_v2 = reader_v2
    ds = ray.data.read_parquet(files, columns=columns)
    return ds if limit is None else ds.limit(limit)


def download_cifar10(root: str, url: str = CIFAR10_URL, timeout_s: float = 30.0) -> None:
    """Fetch CIFAR-10 with torchvision and write it as ``<root>/cifar10/{train,test}/*.parquet``.

    Rows become JPEG bytes (quality 95) + int label, the layout of the shared parquet copy.
    """
    import socket
    import urllib.error

    from PIL import Image
    from torchvision.datasets import CIFAR10

    target = Path(root) / "cifar10"
    with tempfile.TemporaryDirectory() as tmp:
        CIFAR10.url = url
        previous = socket.getdefaulttimeout()
        socket.setdefaulttimeout(timeout_s)
        try:
            splits = {name: CIFAR10(tmp, train=name == "train", download=True) for name in ("train", "test")}
        except (urllib.error.URLError, OSError, tarfile.TarError, RuntimeError) as err:
            raise PipelineError(
                f"CIFAR-10 is not at {target.resolve()} and downloading it from {url} failed ({err}). "
                "If this machine is offline, copy the parquet files there, or point the pipeline at the "
                "directory that contains cifar10/: PIPELINE_DATA_DIR=/path/to/data (for example "
                "PIPELINE_DATA_DIR=../shared/data) or source.root=/path/to/data."
            ) from err
        finally:
            socket.setdefaulttimeout(previous)
        for name, dataset in splits.items():
            out = target / name
            out.mkdir(parents=True, exist_ok=True)
            images = []
            for array in dataset.data:
                buffer = io.BytesIO()
                Image.fromarray(array).save(buffer, format="JPEG", quality=95)
                images.append(buffer.getvalue())
            table = pa.table({"image": pa.array(images, pa.binary()), "label": pa.array(dataset.targets, pa.int64())})
            pq.write_table(table, out / "part-00000.parquet", row_group_size=1000, compression="none")
