"""Image transforms for batches of rows: encoded images in, uint8 (N, C, H, W) arrays out.

Pixels stay uint8 through Ray Data (a quarter of float32's bytes to move); the training worker
scales them on its device (``ingest.normalize``)."""

from __future__ import annotations

import io
import logging
import zlib
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import simplejpeg
from PIL import Image, UnidentifiedImageError

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


def decode_image(
    batch: Batch,
    column: str = "image",
    size: int | None = None,
    fit: Literal["center_crop", "stretch"] = "center_crop",
    channels: Literal[1, 3] = 3,
    on_error: Literal["raise", "skip"] = "raise",
    path_column: str = "path",
) -> Batch:
    """Decode a column of encoded images (JPEG, PNG, WebP, ...) into a uint8 array (N, channels, H, W).

    A value is the file's bytes, or a struct with a ``bytes`` field (Hugging Face's image layout,
    ``{bytes, path}``). JPEGs take simplejpeg's path (libjpeg-turbo, no torch import, and with
    ``size`` a DCT-domain downscale while decoding); other formats go through Pillow. Grayscale,
    palette and RGBA images become ``channels`` (1: gray, 3: RGB). With ``size``, each image is scaled
    so its shorter side is ``size`` and center-cropped (``fit: center_crop``), or stretched
    (``fit: stretch``), to ``size`` x ``size``, so a batch may mix sizes; without it, the images of a
    batch must share one size. A row that does not decode fails the run with its file and row
    (``path_column`` is the source file, which the pipeline's reader adds), or with
    ``on_error="skip"`` is dropped and counted in a warning in Ray's worker logs.
    """
    if on_error not in ("raise", "skip"):
        raise ValueError(f"decode_image: on_error must be 'raise' or 'skip', got {on_error!r}")
    images, keep = [], np.ones(len(batch[column]), dtype=bool)
    for i, value in enumerate(batch[column]):
        try:
            images.append(_decoded(value, size, fit, gray=channels == 1))
        except Exception as err:  # whatever the decoder raises (ValueError, TypeError for a null), the row is bad
            where = _row_in_file(batch[path_column][i], column, value) if path_column in batch else ""
            if on_error == "raise":
                raise ValueError(
                    f"decode_image: column {column!r}{where} holds {value!r:.60}, not an image that decodes "
                    f"({type(err).__name__}: {err}); fix the row, or skip such rows with on_error: skip."
                ) from err
            keep[i] = False
            log.warning("decode_image: skipped an undecodable row%s", where)
    if not keep.all():
        log.warning("decode_image: skipped %d of %d rows in this batch", (~keep).sum(), len(keep))
        batch = {key: values[keep] for key, values in batch.items()}
    shapes = {image.shape for image in images}
    if len(shapes) > 1:
        sizes = ", ".join(sorted(f"{s[1]}x{s[0]}" for s in shapes))
        raise ValueError(
            f"decode_image: column {column!r} mixes image sizes ({sizes}) in one batch; "
            "set size (and fit) on the decode step to bring every image to one size."
        )
    if not images:
        return {**batch, column: np.empty((0, channels, size or 0, size or 0), dtype=np.uint8)}
    pixels = np.stack(images)  # (N, H, W) gray or (N, H, W, 3)
    pixels = pixels[:, None] if channels == 1 else pixels.transpose(0, 3, 1, 2)
    return {**batch, column: np.ascontiguousarray(pixels)}


def _decoded(value: Any, size: int | None, fit: str, gray: bool) -> np.ndarray:
    """One image as (H, W) or (H, W, 3) uint8, at ``size`` when given."""
    data = value["bytes"] if isinstance(value, dict) else value
    if not isinstance(data, bytes):
        raise TypeError(f"expected bytes or a struct with a 'bytes' field, got {type(data).__name__}")
    if data[:3] == b"\xff\xd8\xff":  # JPEG: decoded straight to the channels wanted, scaled down in the DCT
        image = simplejpeg.decode_jpeg(
            data, colorspace="GRAY" if gray else "RGB", min_height=size or 0, min_width=size or 0
        )
        image = image[..., 0] if gray else image
    else:
        try:
            opened = Image.open(io.BytesIO(data))
        except UnidentifiedImageError:
            raise ValueError("not a known image format (JPEG, PNG, WebP, GIF, BMP, ...)") from None
        with opened:
            image = np.asarray(opened.convert("L" if gray else "RGB"))
    if size is None or image.shape[:2] == (size, size):
        return image
    return np.asarray(_resized(Image.fromarray(image), size, fit))


def _resized(image: Image.Image, size: int, fit: str) -> Image.Image:
    """``image`` stretched to ``size`` x ``size``, or scaled to a shorter side of ``size`` and center-cropped."""
    if fit == "stretch":
        return image.resize((size, size), Image.Resampling.BILINEAR)
    width, height = image.size
    scale = size / min(width, height)
    width, height = max(size, round(width * scale)), max(size, round(height * scale))
    left, top = (width - size) // 2, (height - size) // 2
    return image.resize((width, height), Image.Resampling.BILINEAR).crop((left, top, left + size, top + size))


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
