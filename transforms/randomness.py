"""Seeded random draws per row, the same wherever a row is augmented: in a Ray Data task on the CPU or on the
training device (:mod:`transforms.device`), in any batch, order or worker.

The pipeline numbers every training row (the column ``ROW``, its place in the split in file order) and hands the
number to every step; a seeded step keys its draws on it. Without the column (a step called on its own, or a split
that is not numbered), a row is keyed by a hash of its pixels or bytes.
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np

ROW = "_pipeline_row"  # the training split's row numbers: the key of each row's draws, and what the ledger counts
EPOCH = "_pipeline_epoch"  # the training epoch a row was read for (pipeline.data.epochs), taken off by the steps


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer over a uint64 array: a cheap, well-spread hash (arithmetic wraps mod 2**64)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def row_uniform(
    images: np.ndarray, seed: int | None, epoch: int, salt: int, draws: int, rows: np.ndarray | None = None
) -> np.ndarray:
    """``draws`` uniform numbers in [0, 1) per image, shape (N, draws). ``images``: decoded pixels (N, C, H, W), or a
    column of encoded values or ragged pixels; ``rows``: the rows' numbers (``ROW``), when the batch has them.

    Unseeded, they are fresh each call. Seeded, each row's numbers depend only on (seed, epoch, salt, and the row's
    number, else its pixels or bytes), so which task, batch, worker or device handles a row, and in what order, does
    not change its augmentation, while each epoch still gets a new one. ``salt`` keeps steps independent.
    """
    if seed is None:
        return np.random.default_rng().random((len(images), draws))
    if rows is not None:
        keys = np.asarray(rows, dtype=np.int64).astype(np.uint64) + np.uint64(1 << 40)  # apart from pixel hashes
    else:
        keys = np.fromiter((_row_key(image) for image in images), dtype=np.uint64, count=len(images))
    base = np.random.SeedSequence([seed, epoch, salt]).generate_state(1, np.uint64)[0]
    counters = (keys[:, None] << np.uint64(16)) + np.arange(draws, dtype=np.uint64)[None, :]
    return (_mix(_mix(counters) ^ base) >> np.uint64(11)).astype(np.float64) * 2.0**-53


def _row_key(value: Any) -> int:
    """A row's hash: of its pixels, or of its encoded bytes (0 for a value that is neither: a null)."""
    data = value.get("bytes") if isinstance(value, dict) else value
    if isinstance(data, np.ndarray):  # pixels: a large image is keyed by about 4,096 of them, spread over it
        flat = np.ascontiguousarray(data).reshape(-1)
        return zlib.crc32(np.ascontiguousarray(flat[:: max(1, flat.size // 4096)]))
    return zlib.crc32(data) if isinstance(data, bytes) else 0


CROP_TRIES = 10  # torchvision's RandomResizedCrop tries ten windows before it falls back to the centre


def crop_boxes(
    heights: np.ndarray, widths: np.ndarray, u: np.ndarray, scale: tuple[float, float], ratio: tuple[float, float]
) -> np.ndarray:
    """(top, left, h, w) per image, shape (N, 4), of a random window as torchvision's ``RandomResizedCrop.get_params``
    draws it, from ``u``: (N, 4 * CROP_TRIES) uniform numbers (4 per try: area, aspect, top, left). The first try
    that fits wins; with none, the centre at the nearest allowed aspect."""
    heights, widths = np.asarray(heights, dtype=np.float64), np.asarray(widths, dtype=np.float64)
    tries = u[:, : 4 * CROP_TRIES].reshape(len(u), CROP_TRIES, 4)
    log_ratio = np.log(ratio)
    area = (heights * widths)[:, None] * (scale[0] + tries[..., 0] * (scale[1] - scale[0]))
    aspect = np.exp(log_ratio[0] + tries[..., 1] * (log_ratio[1] - log_ratio[0]))
    w, h = np.round(np.sqrt(area * aspect)), np.round(np.sqrt(area / aspect))  # round half to even, as Python's
    fits = (w > 0) & (h > 0) & (w <= widths[:, None]) & (h <= heights[:, None])
    first = fits.argmax(axis=1)
    pick = np.arange(len(u)), first
    h, w = h[pick], w[pick]
    top = (tries[..., 2][pick] * (heights - h + 1)).astype(np.int64)
    left = (tries[..., 3][pick] * (widths - w + 1)).astype(np.int64)
    # no try fitted: the centre, at the nearest allowed aspect
    aspect = widths / np.maximum(heights, 1)
    cw = np.where(aspect > max(ratio), np.round(heights * max(ratio)), widths)
    ch = np.where(aspect < min(ratio), np.round(widths / min(ratio)), heights)
    centre = ~fits.any(axis=1)
    h, w = np.where(centre, ch, h), np.where(centre, cw, w)
    top = np.where(centre, (heights - h) // 2, top)
    left = np.where(centre, (widths - w) // 2, left)
    return np.stack([top, left, h, w], axis=1).astype(np.int64)
