"""Image transforms for batches of CIFAR-style rows: JPEG bytes in, uint8 (N, C, H, W) arrays out.

Pixels stay uint8 through Ray Data (a quarter of float32's bytes to move); the training worker
scales them on its device (``ingest.normalize``)."""

from __future__ import annotations

import logging
import zlib
from typing import Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import simplejpeg

Batch = dict[str, np.ndarray]
log = logging.getLogger(__name__)


def _row_in_file(path: str, column: str, value: bytes) -> str:
    """`` row R of FILE`` for a value read from a local parquet file, else `` in FILE`` (a remote
    file, or one that cannot be searched): error messages only, so cost does not matter."""
    try:
        values = pq.read_table(path, columns=[column]).column(column).to_pylist()
        return f" row {values.index(value)} of {path}"
    except (OSError, ValueError, pa.ArrowException):
        return f" in {path}"


def decode_jpeg(
    batch: Batch, column: str = "image", on_error: Literal["raise", "skip"] = "raise", path_column: str = "path"
) -> Batch:
    """Decode a column of JPEG bytes into a uint8 array of shape (N, C, H, W).

    simplejpeg (libjpeg-turbo) decodes small JPEGs faster than torchvision and needs no torch, so
    Ray Data's workers start without importing it. Images in one batch must share a size,
    as CIFAR's do. A row that does not decode fails the run with its file and row (``path_column`` is
    the source file, which the pipeline's reader adds), or with ``on_error="skip"`` is dropped and
    counted in a warning in Ray's worker logs.
    """
    if on_error not in ("raise", "skip"):
        raise ValueError(f"decode_jpeg: on_error must be 'raise' or 'skip', got {on_error!r}")
    images, keep = [], np.ones(len(batch[column]), dtype=bool)
    for i, data in enumerate(batch[column]):
        try:
            images.append(simplejpeg.decode_jpeg(data, colorspace="RGB"))
        except Exception as err:  # whatever the decoder raises (ValueError, TypeError for a null), the row is bad
            where = _row_in_file(batch[path_column][i], column, data) if path_column in batch else ""
            held = "bytes that are not a valid JPEG" if isinstance(data, bytes) else f"{data!r:.40}, not JPEG bytes"
            if on_error == "raise":
                raise ValueError(
                    f"decode_jpeg: column {column!r}{where} holds {held} ({type(err).__name__}: {err}); "
                    "fix the row, or skip such rows with on_error: skip."
                ) from err
            keep[i] = False
            log.warning("decode_jpeg: skipped an undecodable row%s", where)
    if not keep.all():
        log.warning("decode_jpeg: skipped %d of %d rows in this batch", (~keep).sum(), len(keep))
        batch = {key: values[keep] for key, values in batch.items()}
    pixels = np.stack(images).transpose(0, 3, 1, 2) if images else np.empty((0, 3, 0, 0), dtype=np.uint8)
    return {**batch, column: np.ascontiguousarray(pixels)}


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer over a uint64 array: a cheap, well-spread hash (arithmetic wraps mod 2**64)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def row_uniform(images: np.ndarray, seed: int | None, epoch: int, salt: int, draws: int) -> np.ndarray:
    """``draws`` uniform numbers in [0, 1) per image, shape (N, draws).

    Unseeded, they are fresh each call. Seeded, each row's numbers depend only on (seed, epoch, the
    row's pixels, salt), so which task, batch or worker handles a row, and in what order, does not
    change its augmentation, while each epoch still gets a new one. ``salt`` keeps steps independent.
    """
    if seed is None:
        return np.random.default_rng().random((len(images), draws))
    images = np.ascontiguousarray(images)
    keys = np.fromiter((zlib.crc32(image) for image in images), dtype=np.uint64, count=len(images))
    base = np.random.SeedSequence([seed, epoch, salt]).generate_state(1, np.uint64)[0]
    counters = (keys[:, None] << np.uint64(32)) + np.arange(draws, dtype=np.uint64)[None, :]
    return (_mix(counters ^ base) >> np.uint64(11)).astype(np.float64) * 2.0**-53


def random_crop(
    batch: Batch, column: str = "image", size: int = 32, padding: int = 4, seed: int | None = None, epoch: int = 0
) -> Batch:
    """Zero-pad each (N, C, H, W) image by ``padding`` and cut a random ``size`` x ``size`` window
    (reproducible per row and epoch with ``seed``; see :func:`row_uniform`). The pipeline passes
    ``epoch``."""
    images = batch[column]
    padded = np.pad(images, ((0, 0), (0, 0), (padding, padding), (padding, padding)))
    windows = np.lib.stride_tricks.sliding_window_view(padded, (size, size), axis=(2, 3))  # (N, C, T, L, s, s)
    top, left = (row_uniform(images, seed, epoch, salt=1, draws=2) * windows.shape[2:4]).astype(np.int64).T
    return {**batch, column: windows[np.arange(len(images)), :, top, left]}  # one gather: (N, C, size, size)


def random_flip(batch: Batch, column: str = "image", p: float = 0.5, seed: int | None = None, epoch: int = 0) -> Batch:
    """Mirror each (N, C, H, W) image left-right with probability ``p`` (reproducible per row and
    epoch with ``seed``; see :func:`row_uniform`). The pipeline passes ``epoch``."""
    images = batch[column].copy()
    flip = row_uniform(images, seed, epoch, salt=2, draws=1)[:, 0] < p
    images[flip] = images[flip][..., ::-1]
    return {**batch, column: images}
