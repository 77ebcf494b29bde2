"""Image transforms for batches of CIFAR-style rows (JPEG bytes in, float CHW tensors out)."""
from __future__ import annotations

import logging
import zlib
from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from ray.data import DataContext
from torchvision.io import ImageReadMode, decode_jpeg as _decode_jpeg

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


def decode_jpeg(batch: Batch, column: str = "image", on_error: str = "raise", path_column: str = "path") -> Batch:
    """Decode a column of JPEG bytes into a uint8 array of shape (N, C, H, W).

    torchvision's batched decoder is about 3x faster than PIL per core; images in one batch must
    share a size, as CIFAR's do. A row that does not decode fails the run with its file and row
    (``path_column`` is the source file, which the pipeline's reader adds), or with
    ``on_error="skip"`` is dropped and counted in a warning in Ray's worker logs.
    """
    if on_error not in ("raise", "skip"):
        raise ValueError(f"decode_jpeg: on_error must be 'raise' or 'skip', got {on_error!r}")
    encoded = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in batch[column]]
    try:
        images = _decode_jpeg(encoded, mode=ImageReadMode.RGB)
    except RuntimeError:
        images = []
        for i, data in enumerate(encoded):
            try:
                images.append(_decode_jpeg(data, mode=ImageReadMode.RGB))
            except RuntimeError as err:
                where = _row_in_file(batch[path_column][i], column, batch[column][i]) if path_column in batch else ""
                if on_error == "raise":
                    raise ValueError(f"decode_jpeg: column {column!r}{where} holds bytes that are not a valid JPEG "
                                     f"({err}); fix the row, or skip such rows with on_error: skip.") from err
                images.append(None)
                log.warning("decode_jpeg: skipped an undecodable row%s", where)
    keep = np.array([image is not None for image in images], dtype=bool)
    if not keep.all():
        log.warning("decode_jpeg: skipped %d of %d rows in this batch", (~keep).sum(), len(keep))
        batch = {key: values[keep] for key, values in batch.items()}
    decoded = [image for image in images if image is not None]
    pixels = torch.stack(decoded).numpy() if decoded else np.empty((0, 3, 0, 0), dtype=np.uint8)
    return {**batch, column: pixels}


def _execution_index() -> int:
    """Which pass over the dataset this is: Ray Data counts each execution of a dataset (one per
    epoch under Ray Train) in its context, the counter it uses itself to reseed shuffles per epoch."""
    return DataContext.get_current()._execution_idx


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer over a uint64 array: a cheap, well-spread hash (arithmetic wraps mod 2**64)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def row_uniform(images: np.ndarray, seed: int | None, salt: int, draws: int) -> np.ndarray:
    """``draws`` uniform numbers in [0, 1) per image, shape (N, draws).

    Unseeded, they are fresh each call. Seeded, each row's numbers depend only on (seed, epoch, the
    row's pixels, salt), so which task, batch or worker handles a row, and in what order, does not
    change its augmentation, while each epoch still gets a new one. ``salt`` keeps steps independent.
    """
    if seed is None:
        return np.random.default_rng().random((len(images), draws))
    keys = np.fromiter((zlib.crc32(image.tobytes()) for image in images), dtype=np.uint64, count=len(images))
    base = np.random.SeedSequence([seed, _execution_index(), salt]).generate_state(1, np.uint64)[0]
    counters = (keys[:, None] << np.uint64(32)) + np.arange(draws, dtype=np.uint64)[None, :]
    return (_mix(counters ^ base) >> np.uint64(11)).astype(np.float64) * 2.0**-53


def random_crop(batch: Batch, column: str = "image", size: int = 32, padding: int = 4, seed: int | None = None) -> Batch:
    """Zero-pad each (N, C, H, W) image by ``padding`` and cut a random ``size`` x ``size`` window
    (reproducible per row and epoch with ``seed``; see :func:`row_uniform`)."""
    images = batch[column]
    padded = np.pad(images, ((0, 0), (0, 0), (padding, padding), (padding, padding)))
    max_offset = padded.shape[-1] - size
    offsets = (row_uniform(images, seed, salt=1, draws=2) * (max_offset + 1)).astype(np.int64)
    out = np.empty((*images.shape[:2], size, size), dtype=images.dtype)
    for i, (top, left) in enumerate(offsets):
        out[i] = padded[i, :, top : top + size, left : left + size]
    return {**batch, column: out}


def random_flip(batch: Batch, column: str = "image", p: float = 0.5, seed: int | None = None) -> Batch:
    """Mirror each (N, C, H, W) image left-right with probability ``p`` (reproducible per row and
    epoch with ``seed``; see :func:`row_uniform`)."""
    images = batch[column].copy()
    flip = row_uniform(images, seed, salt=2, draws=1)[:, 0] < p
    images[flip] = images[flip][..., ::-1]
    return {**batch, column: images}


def normalize(
    batch: Batch,
    column: str = "image",
    mean: Sequence[float] = (0.5, 0.5, 0.5),
    std: Sequence[float] = (0.5, 0.5, 0.5),
) -> Batch:
    """Scale uint8 pixels to [0, 1], then standardize per channel: float32 (x/255 - mean) / std."""
    mean_ = np.asarray(mean, dtype=np.float32).reshape(1, -1, 1, 1)
    std_ = np.asarray(std, dtype=np.float32).reshape(1, -1, 1, 1)
    images = batch[column].astype(np.float32) / 255.0
    return {**batch, column: (images - mean_) / std_}
