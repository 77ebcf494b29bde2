"""Image transforms for batches of rows: encoded images in, uint8 (N, C, H, W) arrays out.

Pixels stay uint8 through Ray Data (a quarter of float32's bytes to move); the training worker
scales them on its device (``ingest.normalize``)."""

from __future__ import annotations

import io
import logging
import warnings
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import simplejpeg
from PIL import Image, UnidentifiedImageError

from transforms.randomness import CROP_TRIES, ROW, crop_boxes, row_uniform

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
    *,
    column: str = "image",
    size: int | None = None,
    fit: Literal["center_crop", "stretch"] = "center_crop",
    resize: int | None = None,
    channels: Literal[1, 3] = 3,
    on_error: Literal["raise", "skip"] = "raise",
    path_column: str = "path",
) -> Batch:
    """Decode a column of encoded images (JPEG, PNG, WebP, ...) into a uint8 array (N, channels, H, W).

    A value is the file's bytes, or a struct with a ``bytes`` field (Hugging Face's image layout, ``{bytes, path}``).
    JPEGs take simplejpeg's path (libjpeg-turbo); other formats go through Pillow. Grayscale, palette and RGBA images
    become ``channels`` (1: gray, 3: RGB). With ``size``, each image is scaled so its shorter side is ``resize``
    (default ``size``) and its centre ``size`` x ``size`` cut out (``fit: center_crop``; ImageNet's validation transform
    is ``resize: 256, size: 224``), or stretched to ``size`` x ``size`` (``fit: stretch``), so a batch may mix sizes.
    With ``resize`` alone, each image is scaled so its shorter side is ``resize``, its aspect kept: a working size for
    photos whose pixels are cached and cropped every epoch (:func:`random_resized_crop` takes them), and the batch's
    images keep their different shapes. Without either, the images of a batch must share one size. A row that does not
    decode fails the run with its file and row (``path_column`` is the source file, which the pipeline's reader adds),
    or with ``on_error="skip"`` is dropped and counted in a warning in Ray's worker logs.
    """
    if fit not in ("center_crop", "stretch"):
        raise ValueError(f"decode_image: fit must be 'center_crop' or 'stretch', got {fit!r}")
    rows = {"column": column, "channels": channels, "on_error": on_error, "path_column": path_column}
    if size is None and resize is None:
        return _each_row("decode_image", batch, **rows, image_of=lambda _, data: _decode(data, channels))
    if size is None:

        def working_size(_: int, data: bytes) -> np.ndarray:
            height, width = _dimensions(data)
            longer = int(resize * max(height, width) / min(height, width))  # truncated, as torchvision's Resize
            out = (resize, longer) if height <= width else (longer, resize)
            image = _decode(data, channels, _dct_shrink(height, width, *out))
            return _resized(image, (0, 0, height, width), out, (height, width))

        return _each_row("decode_image", batch, **rows, image_of=working_size, ragged=True)

    def fitted(_: int, data: bytes) -> np.ndarray:
        height, width = _dimensions(data)
        if fit == "stretch":
            image = _decode(data, channels, _dct_shrink(height, width, size, size))
            return _resized(image, (0, 0, image.shape[1], image.shape[2]), size)
        shorter = resize or size
        side = min(height, width) * size / shorter  # the centre square, in source pixels
        top, left = (height - side) / 2, (width - side) / 2
        shrink = _dct_shrink(height, width, height * shorter / min(height, width), width * shorter / min(height, width))
        return _resized(_decode(data, channels, shrink), (top, left, side, side), size, (height, width))

    return _each_row("decode_image", batch, **rows, image_of=fitted, size=size)


def random_resized_crop(
    batch: Batch,
    *,
    column: str = "image",
    size: int = 224,
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
    flip: float = 0.0,
    channels: Literal[1, 3] = 3,
    on_error: Literal["raise", "skip"] = "raise",
    path_column: str = "path",
    seed: int | None = None,
    epoch: int = 0,
) -> Batch:
    """Decode each encoded image and cut a random window of it, resized to ``size`` x ``size``: the
    ImageNet training crop (torchvision's ``RandomResizedCrop``: a ``scale`` fraction of the area at an
    aspect ``ratio``, ten tries, then the centre), on a batch of mixed sizes, to uint8 (N, channels, size, size).

    Values may also be decoded pixels, (C, H, W) uint8 (``decode_image`` with ``resize``, cached once): then each epoch
    only cuts and resizes. The window is drawn from the image's header before decoding, so a JPEG whose window is at
    least twice ``size`` is decoded at 1/2, 1/4 or 1/8 scale by libjpeg-turbo (DCT scaling: less work than decoding
    every pixel and shrinking after). Resizing is bilinear with antialiasing, as torchvision's. ``flip`` is the
    probability of mirroring a window left-right (``RandomHorizontalFlip`` after the crop): free here, since the window
    is reversed as the batch is stacked, where a separate :func:`random_flip` step copies the batch again. Values,
    errors and ``channels`` as :func:`decode_image`; reproducible per row and epoch with ``seed`` (see
    :func:`transforms.randomness.row_uniform`); :class:`transforms.device.RandomResizedCrop` cuts the same windows on
    the training device. The pipeline passes ``epoch``.
    """
    values = batch[column]
    dims = np.array([_dimensions(_encoded(value)) if _readable(value) else (1, 1) for value in values]).reshape(-1, 2)
    boxes, flips = resized_crop_plan(
        values, dims, scale=scale, ratio=ratio, flip=flip, seed=seed, epoch=epoch, rows=batch.get(ROW)
    )

    def cropped(i: int, data: bytes) -> np.ndarray:
        return cropped_window(data, boxes[i], flips[i], size, channels)

    rows = {"column": column, "channels": channels, "on_error": on_error, "path_column": path_column}
    return _each_row("random_resized_crop", batch, **rows, image_of=cropped, size=size)


def cropped_window(data: bytes | np.ndarray, box: np.ndarray, flip: bool, size: int, channels: int) -> np.ndarray:
    """One image's window ``box`` (top, left, h, w) resized to ``size`` x ``size``, mirrored with ``flip``, uint8
    (channels, size, size): a JPEG decoded at the smallest DCT scale that keeps the window at least ``size``."""
    height, width = _dimensions(data)
    top, left, h, w = box
    image = _decode(data, channels, _dct_shrink(height, width, height * size / h, width * size / w))
    window = _resized(image, (top, left, h, w), size, (height, width))
    return window[..., ::-1] if flip else window


def resized_crop_plan(
    values: np.ndarray,
    dims: np.ndarray,
    *,
    scale: tuple[float, float],
    ratio: tuple[float, float],
    flip: float,
    seed: int | None,
    epoch: int,
    rows: np.ndarray | None,
) -> tuple[np.ndarray, np.ndarray]:
    """Each row's window (top, left, h, w) in its image's pixels, (N, 4), and whether it is mirrored, (N,): the draws
    of :func:`random_resized_crop`, wherever it runs. ``dims``: each image's (height, width); ``values`` and ``rows``
    key the draws (:func:`transforms.randomness.row_uniform`)."""
    draws = row_uniform(values, seed, epoch, salt=3, draws=4 * CROP_TRIES + 1, rows=rows)  # the windows', the flip
    return crop_boxes(dims[:, 0], dims[:, 1], draws[:, :-1], scale, ratio), draws[:, -1] < flip


def _readable(value: Any) -> bool:
    """Whether a value's size can be read (a bad one fails later, in :func:`_each_row`, naming its row)."""
    try:
        _dimensions(_encoded(value))
        return True
    except Exception:
        return False


def _each_row(
    step: str,
    batch: Batch,
    *,
    column: str,
    channels: int,
    on_error: str,
    path_column: str,
    image_of,
    size: int | None = None,
    ragged: bool = False,
) -> Batch:
    """``image_of(i, encoded bytes or pixels)`` -> (channels, H, W) for every row, stacked into ``column``
    (``ragged``: as an object array of images, whose shapes may differ, which Ray Data keeps as
    variable-shaped tensors); a row that fails is named (file and row) in the error raised, or dropped from every column
    with ``skip``."""
    if on_error not in ("raise", "skip"):
        raise ValueError(f"{step}: on_error must be 'raise' or 'skip', got {on_error!r}")
    images, keep = [], np.ones(len(batch[column]), dtype=bool)
    for i, value in enumerate(batch[column]):
        try:
            images.append(image_of(i, _encoded(value)))
        except Exception as err:  # whatever the decoder raises (ValueError, TypeError for a null), the row is bad
            where = _row_in_file(batch[path_column][i], column, value) if path_column in batch else ""
            if on_error == "raise":
                raise ValueError(
                    f"{step}: column {column!r}{where} holds {value!r:.60}, not an image that decodes "
                    f"({type(err).__name__}: {err}); fix the row, or skip such rows with on_error: skip."
                ) from err
            keep[i] = False
            log.warning("%s: skipped an undecodable row%s", step, where)
    if not keep.all():
        log.warning("%s: skipped %d of %d rows in this batch", step, (~keep).sum(), len(keep))
        batch = {key: values[keep] for key, values in batch.items()}
    shapes = {image.shape for image in images}
    if ragged:  # an object array even when this batch's shapes agree: every batch of the column alike
        column_of_images = np.empty(len(images), dtype=object)
        for i, image in enumerate(images):
            column_of_images[i] = image
        return {**batch, column: column_of_images}
    if len(shapes) > 1:
        sizes = sorted(f"{s[2]}x{s[1]}" for s in shapes)
        sizes = ", ".join(sizes[:4]) + (f", ... {len(sizes)} sizes" if len(sizes) > 4 else "")
        raise ValueError(
            f"{step}: column {column!r} mixes image sizes ({sizes}) in one batch; "
            "set size (and fit) on the decode step to bring every image to one size."
        )
    if not images:
        return {**batch, column: np.empty((0, channels, size or 0, size or 0), dtype=np.uint8)}
    return {**batch, column: np.stack(images)}


def _encoded(value: Any) -> bytes | np.ndarray:
    """A row's image: the encoded bytes themselves, a Hugging Face struct's ``bytes`` field, or
    pixels already decoded, (C, H, W) uint8."""
    data = value["bytes"] if isinstance(value, dict) else value
    if isinstance(data, np.ndarray) and data.ndim == 3 and data.dtype == np.uint8:
        return data
    if not isinstance(data, bytes):
        raise TypeError(f"expected bytes or a struct with a 'bytes' field, got {type(data).__name__}")
    return data


def _is_jpeg(data: bytes | np.ndarray) -> bool:
    return isinstance(data, bytes) and data[:3] == b"\xff\xd8\xff"


def _dimensions(data: bytes | np.ndarray) -> tuple[int, int]:
    """(height, width), read from the header without decoding the pixels (or the pixels' shape)."""
    if isinstance(data, np.ndarray):
        return data.shape[1], data.shape[2]
    if _is_jpeg(data):
        return simplejpeg.decode_jpeg_header(data)[:2]
    width, height = _opened(data).size
    return height, width


def _opened(data: bytes) -> Image.Image:
    try:
        return Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        raise ValueError("not a known image format (JPEG, PNG, WebP, GIF, BMP, ...)") from None


def _dct_shrink(height: int, width: int, min_height: float, min_width: float) -> int:
    """The largest of 1, 2, 4, 8 that a JPEG can be shrunk by while decoding and stay at least
    ``min_height`` x ``min_width``. Only these factors: libjpeg-turbo's others (3/8, 7/8, ...) decode
    slower than full size."""
    shrink = 1
    while shrink < 8 and height / (2 * shrink) >= min_height and width / (2 * shrink) >= min_width:
        shrink *= 2
    return shrink


def _decode(data: bytes, channels: int, shrink: int = 1) -> np.ndarray:
    """The image as uint8 (channels, H, W); a JPEG decoded at 1/``shrink`` scale (its DCT does the scaling).
    Pixels already decoded come back as they are (gray repeated to RGB when ``channels`` is 3)."""
    gray = channels == 1
    if isinstance(data, np.ndarray):
        if data.shape[0] == channels:
            return data
        if data.shape[0] == 1:
            return np.repeat(data, channels, axis=0)
        raise ValueError(f"holds {data.shape[0]}-channel pixels where {channels} are asked for")
    if _is_jpeg(data):
        height, width = _dimensions(data) if shrink > 1 else (0, 0)  # the header is read again only to shrink
        image = simplejpeg.decode_jpeg(
            data, colorspace="GRAY" if gray else "RGB", min_height=-(-height // shrink), min_width=-(-width // shrink)
        )
    else:
        with _opened(data) as opened:
            image = np.asarray(opened.convert("L" if gray else "RGB"))
    return image[None] if image.ndim == 2 else image.transpose(2, 0, 1)


def _resized(
    image: np.ndarray,
    box: tuple[float, float, float, float],
    size: int | tuple[int, int],
    source: tuple[int, int] | None = None,
) -> np.ndarray:
    """The ``box`` (top, left, height, width; in ``source`` pixels, default the image's own) of a
    (C, H, W) image, resized to ``size`` x ``size`` (or ``size`` = (height, width)): bilinear with antialiasing, torch's
    uint8 kernel (torchvision's resize, and several times faster than Pillow's). torch is imported here, not at the top:
    steps that never resize (CIFAR's) spare each of Ray's worker processes its seconds of import."""
    import torch
    from torch.nn import functional

    y, x = (image.shape[1] / source[0], image.shape[2] / source[1]) if source else (1.0, 1.0)
    top, left, height, width = box
    rows = slice(round(top * y), max(round((top + height) * y), round(top * y) + 1))
    cols = slice(round(left * x), max(round((left + width) * x), round(left * x) + 1))
    out = (size, size) if isinstance(size, int) else tuple(size)
    window = image[:, rows, cols]
    if window.shape[1:] == out:
        return np.ascontiguousarray(window)
    # A decoded image is a (C, H, W) view of the decoder's (H, W, C) pixels: torch's uint8 kernel resizes that
    # channels-last layout over twice as fast as a channels-first copy, and writes (C, H, W) all the same.
    with warnings.catch_warnings():  # pixels from Ray's object store are read-only; the kernel only reads them
        warnings.filterwarnings("ignore", "The given NumPy array is not writable", UserWarning)
        tensor = torch.from_numpy(window)[None]
    return functional.interpolate(tensor, size=out, mode="bilinear", antialias=True)[0].numpy()


def random_crop(
    batch: Batch, column: str = "image", size: int = 32, padding: int = 4, seed: int | None = None, epoch: int = 0
) -> Batch:
    """Zero-pad each (N, C, H, W) image by ``padding`` and cut a random ``size`` x ``size`` window
    (reproducible per row and epoch with ``seed``; see :func:`transforms.randomness.row_uniform`;
    :class:`transforms.device.RandomCrop` cuts the same windows on the training device). The pipeline passes
    ``epoch``."""
    images = batch[column]
    padded = np.pad(images, ((0, 0), (0, 0), (padding, padding), (padding, padding)))
    windows = np.lib.stride_tricks.sliding_window_view(padded, (size, size), axis=(2, 3))  # (N, C, T, L, s, s)
    top, left = crop_plan(images, windows.shape[2:4], seed=seed, epoch=epoch, rows=batch.get(ROW))
    return {**batch, column: windows[np.arange(len(images)), :, top, left]}  # one gather: (N, C, size, size)


def crop_plan(
    images: np.ndarray, positions: tuple[int, int], *, seed: int | None, epoch: int, rows: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray]:
    """Each row's window corner (top, left) of :func:`random_crop`, of ``positions`` (rows, columns) it may take."""
    top, left = (row_uniform(images, seed, epoch, salt=1, draws=2, rows=rows) * positions).astype(np.int64).T
    return top, left


def random_flip(batch: Batch, column: str = "image", p: float = 0.5, seed: int | None = None, epoch: int = 0) -> Batch:
    """Mirror each (N, C, H, W) image left-right with probability ``p`` (reproducible per row and epoch with
    ``seed``; see :func:`transforms.randomness.row_uniform`; :class:`transforms.device.RandomFlip` mirrors the same
    rows on the training device). The pipeline passes ``epoch``."""
    images = batch[column].copy()
    flip = flip_plan(images, p, seed=seed, epoch=epoch, rows=batch.get(ROW))
    images[flip] = images[flip][..., ::-1]
    return {**batch, column: images}


def flip_plan(images: np.ndarray, p: float, *, seed: int | None, epoch: int, rows: np.ndarray | None) -> np.ndarray:
    """Whether each row is mirrored by :func:`random_flip`, (N,)."""
    return row_uniform(images, seed, epoch, salt=2, draws=1, rows=rows)[:, 0] < p


# The classes that run these steps on the training device (transforms/device.py): a step's ``on_device`` setting
# looks for its function's ``device_form``, a dotted path; a function of your own can name one the same way.
random_resized_crop.device_form = "transforms.device.RandomResizedCrop"
decode_image.device_form = "transforms.device.DecodeImage"
random_crop.device_form = "transforms.device.RandomCrop"
random_flip.device_form = "transforms.device.RandomFlip"
