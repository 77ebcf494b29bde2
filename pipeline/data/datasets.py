"""Example data sets, written as parquet under ``source.root`` when missing (a source's ``download``): the
real CIFAR-10 (downloaded with torchvision; offline, a clear message), and tables and photographs made from
data that scikit-learn and scikit-image ship, for the examples and the tests.
"""

from __future__ import annotations

import io
import tarfile
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.common.errors import PipelineError

CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"


def download_cifar10(root: str, url: str = CIFAR10_URL, timeout_s: float = 30.0) -> None:
    """Fetch CIFAR-10 with torchvision and write it as ``<root>/cifar10/{train,test}/part-*.parquet``,
    5,000 rows a file: JPEG bytes (quality 95) + int label."""
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
                "directory that contains cifar10/: PIPELINE_DATA_DIR=/path/to/data or source.root=/path/to/data."
            ) from err
        finally:
            socket.setdefaulttimeout(previous)
        for name, dataset in splits.items():
            images = []
            for array in dataset.data:
                buffer = io.BytesIO()
                Image.fromarray(array).save(buffer, format="JPEG", quality=95)
                images.append(buffer.getvalue())
            table = pa.table({"image": pa.array(images, pa.binary()), "label": pa.array(dataset.targets, pa.int64())})
            write_parts(table, target / name, rows_per_file=5000)


def write_parts(table: pa.Table, directory: Path, rows_per_file: int) -> None:
    """``table`` as ``part-NNNNN.parquet`` files of ``rows_per_file`` rows (row groups of 1,000), so Ray
    Data reads and transforms a split in several tasks at once (one per file)."""
    directory.mkdir(parents=True, exist_ok=True)
    for number, start in enumerate(range(0, table.num_rows, rows_per_file)):
        part = table.slice(start, rows_per_file)
        pq.write_table(part, directory / f"part-{number:05d}.parquet", row_group_size=1000, compression="none")


def write_sklearn(root: str, name: str, valid_fraction: float = 0.2, seed: int = 0, vector: bool = False) -> None:
    """Write one of scikit-learn's bundled datasets (``sklearn.datasets.load_<name>``, shipped with the
    package: nothing is downloaded) as ``<root>/<name>/{train,valid}/*.parquet``: a float column per
    feature, named as scikit-learn names it (or, with ``vector``, one list column ``features``), and
    ``target``. Rows are split at random (``seed``) into training and validation."""
    from sklearn import datasets

    try:
        bunch = getattr(datasets, f"load_{name}")()
    except AttributeError as err:
        raise PipelineError(f"source.download.name: scikit-learn has no bundled dataset load_{name}.") from err
    order = np.random.default_rng(seed).permutation(len(bunch.target))
    valid_rows = round(len(order) * valid_fraction)
    if vector:
        features = {"features": pa.array(list(bunch.data.astype(np.float32)), pa.list_(pa.float32()))}
    else:
        features = {column: bunch.data[:, i] for i, column in enumerate(bunch.feature_names)}
    table = pa.table({**features, "target": bunch.target})
    for split, rows in (("valid", order[:valid_rows]), ("train", order[valid_rows:])):
        write_parts(table.take(rows), Path(root) / name / split, rows_per_file=len(rows))


SKIMAGE_PHOTOS = (
    "astronaut",
    "chelsea",
    "coffee",
    "rocket",
    "hubble_deep_field",
    "retina",
    "immunohistochemistry",
    "stereo_motorcycle",
)


def write_photos(
    root: str,
    *,
    rows: int = 6400,
    files: int = 16,
    gray_fraction: float = 0.05,
    seed: int = 0,
    classes: int = 10,
    name: str = "photos",
) -> None:
    """Write a photo-like JPEG set at real sizes as ``<root>/<name>/{train,valid}/*.parquet`` (``image``
    bytes, int ``label``), from ten colour photographs that scikit-learn and scikit-image ship (nothing is
    downloaded). Each row is a random window of one photograph (20-100% of its area), rescaled to a
    shorter side of 256-512 pixels and an aspect up to 4:3 either way, a ``gray_fraction`` of them
    grayscale, at JPEG quality 75-95; the label is the photograph (the first ``classes`` of the ten).
    ``rows`` training rows in ``files`` files, a tenth as many for validation, shuffled."""
    import skimage.data
    from PIL import Image
    from sklearn.datasets import load_sample_images

    photos = list(load_sample_images().images)
    for photo_name in SKIMAGE_PHOTOS:
        photo = getattr(skimage.data, photo_name)()
        photos.append(photo[0] if isinstance(photo, tuple) else photo)  # stereo_motorcycle: (left, right, disparity)
    photos = [Image.fromarray(photo).convert("RGB") for photo in photos[:classes]]
    rng = np.random.default_rng(seed)
    for split, count in (("train", rows), ("valid", max(rows // 10, 1))):
        labels = rng.permutation(np.arange(count) % len(photos))
        images = [photo_window(photos[label], rng, gray_fraction) for label in labels]
        table = pa.table({"image": pa.array(images, pa.binary()), "label": pa.array(labels, pa.int64())})
        write_parts(table, Path(root) / name / split, rows_per_file=-(-count // files))


def photo_window(photo, rng: np.random.Generator, gray_fraction: float) -> bytes:
    """One JPEG: a random window of ``photo`` at a random size (see :func:`write_photos`)."""
    from PIL import Image

    width, height = photo.size
    area, aspect = rng.uniform(0.2, 1.0) * width * height, np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3)))
    w, h = min(width, round(np.sqrt(area * aspect))), min(height, round(np.sqrt(area / aspect)))
    left, top = rng.integers(0, width - w + 1), rng.integers(0, height - h + 1)
    shorter = int(rng.integers(256, 513))
    longer = round(shorter * rng.uniform(1.0, 4 / 3))
    size = (shorter, longer) if rng.random() < 0.5 else (longer, shorter)
    image = photo.resize(size, Image.Resampling.BILINEAR, box=(left, top, left + w, top + h))
    if rng.random() < gray_fraction:
        image = image.convert("L")
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=int(rng.integers(75, 96)))
    return buffer.getvalue()
