"""Image transforms for batches of CIFAR-style rows (JPEG bytes in, float CHW tensors out)."""
from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
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


def random_crop(batch: Batch, column: str = "image", size: int = 32, padding: int = 4) -> Batch:
    """Zero-pad each (N, C, H, W) image by ``padding`` and cut a random ``size`` x ``size`` window."""
    images = batch[column]
    padded = np.pad(images, ((0, 0), (0, 0), (padding, padding), (padding, padding)))
    max_offset = padded.shape[-1] - size
    offsets = np.random.default_rng().integers(0, max_offset + 1, size=(len(images), 2))
    out = np.empty((*images.shape[:2], size, size), dtype=images.dtype)
    for i, (top, left) in enumerate(offsets):
        out[i] = padded[i, :, top : top + size, left : left + size]
    return {**batch, column: out}


def random_flip(batch: Batch, column: str = "image", p: float = 0.5) -> Batch:
    """Mirror each (N, C, H, W) image left-right with probability ``p``."""
    images = batch[column].copy()
    flip = np.random.default_rng().random(len(images)) < p
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
