"""The image steps on the training device (a GPU when the workers have one): each a class built from the same
parameters as its CPU function in :mod:`transforms.image`, run by the training worker on whole batches after Ray
Data hands them over, so per-epoch work (crops, flips, and decoding a streamed split's JPEGs) costs the CPUs nothing.

A device step works in two parts. ``plan`` runs on the CPU, in the thread that collates the batch, and draws each
row's parameters with the CPU function's own code (:func:`transforms.image.resized_crop_plan` and the like, keyed on
the row's number), so a row gets the same window and flip on either side; ``__call__`` applies them to the batch on
the device. Ragged pixels (a working size whose images differ in shape) arrive as :class:`Ragged`: on a GPU one
padded uint8 tensor and each image's size. Encoded images arrive as they were read (bytes, or Hugging Face structs);
a step that takes them decodes on the device: JPEGs with nvJPEG on a GPU (torchvision's batched ``decode_jpeg``),
other formats on the CPU; a CPU worker's crop decodes each JPEG as the CPU function does, at its window's DCT scale.

Resizing is torch's bilinear with antialiasing, as the CPU functions', in two forms that give the same pixels: on a
GPU one pair of batched matrix products (each output row and column a weighted sum of the window's pixels, the
weights torch's), elsewhere torch's own kernel image by image.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from torch.nn import functional

from transforms.image import (
    _dimensions,
    _encoded,
    _is_jpeg,
    crop_plan,
    cropped_window,
    flip_plan,
    resized_crop_plan,
)
from transforms.randomness import ROW

Batch = dict[str, Any]
Params = dict[str, np.ndarray]


@dataclass
class Ragged:
    """Images of different sizes, each (height, width) in ``sizes`` (N, 2): for a GPU one tensor, each image at the
    top left of ``images`` (N, C, H, W, the batch's largest height and width: one copy to the device); on the CPU the
    images themselves, a list of (C, H, W) tensors (no copy at all)."""

    images: torch.Tensor | list[torch.Tensor]
    sizes: torch.Tensor

    def __len__(self) -> int:
        return len(self.sizes)

    def to(self, device: torch.device, non_blocking: bool = False) -> Ragged:
        if isinstance(self.images, list):
            return self  # the CPU's
        moved = (tensor.to(device, non_blocking=non_blocking) for tensor in (self.images, self.sizes))
        return Ragged(*moved)


class RandomResizedCrop:
    """:func:`transforms.image.random_resized_crop` on the device: the same windows and flips per row and epoch,
    cut from pixels (fixed-size, or :class:`Ragged`) or from encoded images decoded here."""

    def __init__(
        self,
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
    ):
        self.column, self.size, self.scale, self.ratio = column, size, tuple(scale), tuple(ratio)
        self.flip, self.channels, self.seed = flip, channels, seed

    @staticmethod
    def unsupported(on_error: str = "raise", **_: Any) -> str | None:
        """Why these parameters cannot run on the device (None: they can)."""
        return "on_error=skip drops rows, which a batch on the device cannot" if on_error == "skip" else None

    def plan(self, batch: Batch, epoch: int) -> Params:
        values = batch[self.column]
        boxes, flips = resized_crop_plan(
            values,
            image_sizes(values),
            scale=self.scale,
            ratio=self.ratio,
            flip=self.flip,
            seed=self.seed,
            epoch=epoch,
            rows=batch.get(ROW),
        )
        return {"boxes": boxes, "flips": flips}

    def __call__(self, batch: Batch, params: Params) -> Batch:
        values, device = batch[self.column], _device_of(batch)
        if device.type == "cpu" and not isinstance(values, (torch.Tensor, Ragged)):  # encoded, for a CPU worker
            return {**batch, self.column: self.cpu_windows(values, params)}
        images = decoded(values, self.channels, device)
        return {**batch, self.column: resize_windows(images, params["boxes"], params["flips"], self.size)}

    def cpu_windows(self, values: Any, params: Params) -> torch.Tensor:
        """Encoded images' windows on the CPU, as the CPU function cuts them: each JPEG decoded at the window's DCT
        scale (a large photo's crop costs a fraction of a full decode), in the feed thread that calls (the decoder
        and torch's resize let go of the GIL)."""
        pairs = zip(values, params["boxes"], params["flips"])
        windows = [cropped_window(_encoded(value), box, flip, self.size, self.channels) for value, box, flip in pairs]
        return torch.from_numpy(np.stack(windows))


class DecodeImage:
    """:func:`transforms.image.decode_image` on the device, for an output of one size (``size`` set): the centre
    ``size`` x ``size`` of each image scaled so its shorter side is ``resize`` (``fit: center_crop``), or the whole
    image stretched (``fit: stretch``). A working size alone (``resize`` without ``size``) keeps the images' shapes
    apart: it is cached on the CPU, never a device step."""

    def __init__(
        self,
        *,
        column: str = "image",
        size: int | None = None,
        fit: Literal["center_crop", "stretch"] = "center_crop",
        resize: int | None = None,
        channels: Literal[1, 3] = 3,
        on_error: Literal["raise", "skip"] = "raise",
        path_column: str = "path",
    ):
        self.column, self.size, self.fit, self.resize, self.channels = column, size, fit, resize, channels

    @staticmethod
    def unsupported(size: int | None = None, on_error: str = "raise", **_: Any) -> str | None:
        if size is None:
            return "without size its images keep their different shapes, which one batch tensor cannot hold"
        return RandomResizedCrop.unsupported(on_error=on_error)

    def plan(self, batch: Batch, epoch: int) -> Params:
        dims = image_sizes(batch[self.column]).astype(np.float64)
        if self.fit == "stretch":
            boxes = np.concatenate([np.zeros_like(dims), dims], axis=1)
        else:
            side = dims.min(axis=1) * self.size / (self.resize or self.size)  # the centre square, in source pixels
            corner = (dims - side[:, None]) / 2
            boxes = np.concatenate([corner, side[:, None], side[:, None]], axis=1)
        boxes = np.round(boxes).astype(np.int64)
        return {"boxes": boxes, "flips": np.zeros(len(boxes), dtype=bool)}

    def __call__(self, batch: Batch, params: Params) -> Batch:
        images = decoded(batch[self.column], self.channels, _device_of(batch))
        return {**batch, self.column: resize_windows(images, params["boxes"], params["flips"], self.size)}


class RandomCrop:
    """:func:`transforms.image.random_crop` on the device: the same zero-padded windows per row and epoch."""

    def __init__(self, *, column: str = "image", size: int = 32, padding: int = 4, seed: int | None = None):
        self.column, self.size, self.padding, self.seed = column, size, padding, seed

    unsupported = staticmethod(lambda **_: None)

    def plan(self, batch: Batch, epoch: int) -> Params:
        images = batch[self.column]
        height, width = images.shape[2] + 2 * self.padding, images.shape[3] + 2 * self.padding
        positions = (height - self.size + 1, width - self.size + 1)
        top, left = crop_plan(images, positions, seed=self.seed, epoch=epoch, rows=batch.get(ROW))
        return {"top": top, "left": left}

    def __call__(self, batch: Batch, params: Params) -> Batch:
        images = batch[self.column]
        pad = self.padding
        padded = functional.pad(images, (pad, pad, pad, pad))
        steps = torch.arange(self.size, device=images.device)
        top = torch.as_tensor(params["top"], device=images.device)[:, None] + steps  # (N, size)
        left = torch.as_tensor(params["left"], device=images.device)[:, None] + steps
        n = torch.arange(len(images), device=images.device)[:, None, None]
        windows = padded.permute(0, 2, 3, 1)[n, top[:, :, None], left[:, None, :]]  # (N, size, size, C)
        return {**batch, self.column: windows.permute(0, 3, 1, 2).contiguous()}


class RandomFlip:
    """:func:`transforms.image.random_flip` on the device: the same rows mirrored per epoch."""

    def __init__(self, *, column: str = "image", p: float = 0.5, seed: int | None = None):
        self.column, self.p, self.seed = column, p, seed

    unsupported = staticmethod(lambda **_: None)

    def plan(self, batch: Batch, epoch: int) -> Params:
        return {"flips": flip_plan(batch[self.column], self.p, seed=self.seed, epoch=epoch, rows=batch.get(ROW))}

    def __call__(self, batch: Batch, params: Params) -> Batch:
        images = batch[self.column]
        flips = torch.as_tensor(params["flips"], device=images.device)[:, None, None, None]
        return {**batch, self.column: torch.where(flips, images.flip(-1), images)}


def image_sizes(values: Any) -> np.ndarray:
    """Each image's (height, width), (N, 2): from ragged pixels, a batch of one size, or encoded headers."""
    if isinstance(values, np.ndarray) and values.dtype != object:
        return np.tile(values.shape[2:4], (len(values), 1))
    return np.array([_dimensions(_encoded(value)) for value in values], dtype=np.int64).reshape(-1, 2)


def _device_of(batch: Batch) -> torch.device:
    """The training device, from the batch's tensors (the labels travel to it whatever the images are)."""
    for value in batch.values():
        if isinstance(value, torch.Tensor):
            return value.device
        if isinstance(value, Ragged) and isinstance(value.images, torch.Tensor):
            return value.images.device
    return torch.device("cpu")


def decoded(values: Any, channels: int, device: torch.device) -> torch.Tensor | Ragged | list[torch.Tensor]:
    """Pixels as they are (a tensor, or :class:`Ragged`), or encoded images decoded on ``device``: a list of uint8
    (C, H, W). JPEGs in one batched call (nvJPEG on a GPU); other formats (PNG, WebP, ...) with torchvision on the
    CPU, then moved."""
    if isinstance(values, (torch.Tensor, Ragged)):
        return values
    from torchvision import io  # here: a worker imports torchvision's decoders only to decode (a second or more)

    mode = io.ImageReadMode.GRAY if channels == 1 else io.ImageReadMode.RGB
    data = [torch.frombuffer(bytearray(_encoded(value)), dtype=torch.uint8) for value in values]
    jpegs = [i for i, value in enumerate(values) if _is_jpeg(_encoded(value))]
    out: list[torch.Tensor | None] = [None] * len(data)
    if jpegs:
        for i, image in zip(jpegs, io.decode_jpeg([data[i] for i in jpegs], mode=mode, device=device)):
            out[i] = image
    for i in sorted(set(range(len(data))) - set(jpegs)):
        out[i] = io.decode_image(data[i], mode=mode).to(device)
    return out


def resize_windows(
    images: torch.Tensor | Ragged | list[torch.Tensor], boxes: np.ndarray, flips: np.ndarray, size: int
) -> torch.Tensor:
    """Each image's window ``boxes[i]`` (top, left, h, w), resized to ``size`` x ``size`` with torch's antialiased
    bilinear and mirrored where ``flips[i]``, as uint8 (N, C, size, size) on the images' device. A batch tensor on a
    GPU goes through :func:`batched_resize` (two matrix products); anything else image by image with torch's kernel
    (on the CPU its uint8 one)."""
    if isinstance(images, Ragged):
        images = images.images
    if isinstance(images, torch.Tensor) and images.is_cuda:
        return batched_resize(images, torch.as_tensor(boxes), torch.as_tensor(flips), size)
    return torch.stack([_resized(image, box, flip, size) for image, box, flip in zip(images, boxes, flips)])


def _resized(image: torch.Tensor, box: np.ndarray, flip: bool, size: int) -> torch.Tensor:
    """One image's window, resized to ``size`` x ``size`` (uint8 on the CPU; float, then rounded, on a GPU)."""
    top, left, h, w = (int(v) for v in box)
    window = image[None, :, top : top + h, left : left + w]
    if window.is_cuda:  # torch's uint8 kernel is the CPU's alone
        window = functional.interpolate(window.float(), size=(size, size), **_BILINEAR).round_().clamp_(0, 255)
    else:
        window = functional.interpolate(window, size=(size, size), **_BILINEAR)
    window = window[0].to(torch.uint8)
    return window.flip(-1) if flip else window


_BILINEAR = {"mode": "bilinear", "antialias": True, "align_corners": False}


def batched_resize(images: torch.Tensor, boxes: torch.Tensor, flips: torch.Tensor, size: int) -> torch.Tensor:
    """:func:`resize_windows` for a batch tensor (N, C, H, W) in one pass: out = Rows @ image @ Columns^T per image,
    where Rows (size x H) and Columns (size x W) hold torch's antialiased bilinear weights of each output pixel over
    the window's pixels (zero outside it; a mirrored window's columns reversed)."""
    device = images.device
    boxes = boxes.to(device=device, dtype=torch.float64)
    rows = resize_weights(boxes[:, 0], boxes[:, 2], size, images.shape[2])  # (N, size, H)
    columns = resize_weights(boxes[:, 1], boxes[:, 3], size, images.shape[3])  # (N, size, W)
    columns = torch.where(flips.to(device)[:, None, None], columns.flip(1), columns)
    pixels = images.float()
    out = torch.matmul(torch.matmul(rows[:, None].float(), pixels), columns[:, None].transpose(2, 3).float())
    return out.round_().clamp_(0, 255).to(torch.uint8)


def resize_weights(start: torch.Tensor, length: torch.Tensor, out: int, extent: int) -> torch.Tensor:
    """(N, out, extent): the weight of each of an axis's ``extent`` pixels in each of ``out`` outputs, resizing the
    window [start, start + length) to ``out`` pixels as torch's antialiased bilinear does (its
    ``_compute_index_ranges_weights``: a triangle filter widened by the scale when shrinking, its support cut at the
    window's edges, normalized)."""
    scale = (length / out)[:, None, None]  # (N, 1, 1)
    support = torch.where(scale >= 1, scale, torch.ones_like(scale))
    inverse = torch.where(scale >= 1, 1 / scale, torch.ones_like(scale))
    centre = scale * (torch.arange(out, device=start.device, dtype=torch.float64)[None, :, None] + 0.5)  # (N, out, 1)
    local = torch.arange(extent, device=start.device, dtype=torch.float64)[None, None, :] - start[:, None, None]
    low = torch.clamp(torch.floor(centre - support + 0.5), min=0)
    high = torch.minimum(torch.floor(centre + support + 0.5), length[:, None, None])
    weights = torch.clamp(1 - ((local - centre + 0.5) * inverse).abs(), min=0) * ((local >= low) & (local < high))
    return weights / weights.sum(dim=2, keepdim=True).clamp(min=1e-12)
