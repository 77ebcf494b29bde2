"""The steps on the training device (transforms/device.py) against their CPU functions, and which steps go there.
Run on the CPU: the GPU path's batched resize is the same arithmetic, checked here against torch's own kernel."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from conftest import compose_cfg, jpeg, photo

from pipeline.common.errors import PipelineError
from pipeline.data import steps
from pipeline.data.feed import Collate
from transforms import decode_image, random_crop, random_flip, random_resized_crop
from transforms.device import (
    DecodeImage,
    Ragged,
    RandomCrop,
    RandomFlip,
    RandomResizedCrop,
    batched_resize,
    decoded,
    resize_windows,
)
from transforms.image import resized_crop_plan
from transforms.randomness import ROW

CPU = torch.device("cpu")


def working_size(count: int, rows: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Photos of mixed shapes decoded to a working size (the shorter side 96), as the cache holds them, with their
    labels and row numbers."""
    pictures = [photo(120 + 37 * (i % 5), 200 - 23 * (i % 4), seed=i) for i in range(count)]
    column = np.array([jpeg(p) for p in pictures], dtype=object)
    batch = decode_image({"image": column, "label": np.arange(count)}, resize=96)
    return {**batch, ROW: np.arange(count) if rows is None else rows}


def on_device(step, batch: dict, epoch: int) -> dict:
    """``step`` as a training worker runs it on a CPU device: planned and collated, then applied."""
    collated = Collate([step], epoch, CPU)(batch)
    return step(collated.batch, collated.params[0])


def test_device_crops_are_the_cpu_steps_crops_of_the_same_rows():
    """Keyed on the row's number, a row gets the same window and flip on either side; torch's uint8 kernel image by
    image (a CPU device) gives the CPU step's pixels, the GPU's batched matrix products the same to one level."""
    batch = working_size(12)
    params = {"size": 64, "flip": 0.5, "seed": 3}
    cpu = random_resized_crop(batch, **params, epoch=2)["image"]
    device = on_device(RandomResizedCrop(**params), batch, epoch=2)["image"]
    assert device.shape == (12, 3, 64, 64) and device.dtype == torch.uint8
    np.testing.assert_array_equal(device.numpy(), cpu)

    padded = for_a_gpu([RandomResizedCrop(**params)], 2)(batch)
    boxes, flips = padded.params[0]["boxes"], padded.params[0]["flips"]
    assert flips.any() and not flips.all()
    batched = batched_resize(padded.batch["image"].images, torch.as_tensor(boxes), torch.as_tensor(flips), 64)
    assert (batched.int() - torch.from_numpy(cpu).int()).abs().max() <= 1
    assert not np.array_equal(on_device(RandomResizedCrop(**params), batch, epoch=3)["image"].numpy(), cpu)


def test_two_images_of_one_batch_get_their_own_windows():
    """The same photo eight times in one batch: eight windows, as eight rows of a DataLoader's batch would get."""
    batch = working_size(1)
    batch = {key: np.repeat(values, 8, axis=0) if key != "image" else values.repeat(8) for key, values in batch.items()}
    batch[ROW] = np.arange(8) + 100
    out = on_device(RandomResizedCrop(size=48, seed=0), batch, epoch=0)["image"]
    assert len({out[i].numpy().tobytes() for i in range(8)}) == 8


def test_the_device_cuts_the_windows_it_planned():
    """On an image whose red channel is its column and green its row, each output's ramps give back the window:
    where it starts, how wide it is, and which way it runs (mirrored rows run backwards)."""
    y, x = np.mgrid[0:200, 0:250]
    image = np.stack([x, y, np.zeros_like(x)]).astype(np.uint8)
    column = np.empty(64, dtype=object)
    column[:] = [image] * 32 + [np.ascontiguousarray(image[:, :180, :220])] * 32
    batch = {"image": column, ROW: np.arange(64)}
    step = RandomResizedCrop(size=50, flip=0.5, seed=1, scale=(0.3, 1.0))
    params = step.plan(batch, epoch=0)
    out = on_device(step, batch, epoch=0)["image"].double()
    centres = (np.arange(50) + 0.5) / 50
    for crop, (top, left, h, w), flip in zip(out, params["boxes"], params["flips"]):
        columns = crop[0, 25].numpy()[::-1] if flip else crop[0, 25].numpy()
        rows = crop[1, :, 25].numpy()
        inner = slice(3, 47)  # the edges' weights are cut at the window's border
        np.testing.assert_allclose(columns[inner], left + centres[inner] * w - 0.5, atol=1.0)
        np.testing.assert_allclose(rows[inner], top + centres[inner] * h - 0.5, atol=1.0)


def test_the_windows_are_drawn_as_torchvision_draws_them():
    """Over 4,000 rows, each window's share of the area and its aspect follow the distribution of torchvision's own
    RandomResizedCrop (its get_params, drawing with torch's generator): a two-sample Kolmogorov-Smirnov test."""
    from scipy.stats import ks_2samp
    from torchvision.transforms import RandomResizedCrop as Torchvision

    count, (height, width) = 4000, (256, 341)
    values = np.empty(count, dtype=object)
    dims = np.tile([height, width], (count, 1))
    boxes, _ = resized_crop_plan(
        values, dims, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3), flip=0.0, seed=5, epoch=0, rows=np.arange(count)
    )
    torch.manual_seed(0)
    image = torch.zeros(3, height, width)
    theirs = np.array([Torchvision.get_params(image, [0.08, 1.0], [3 / 4, 4 / 3]) for _ in range(count)])
    for ours, reference in (
        (boxes[:, 2] * boxes[:, 3], theirs[:, 2] * theirs[:, 3]),
        (boxes[:, 3] / boxes[:, 2], theirs[:, 3] / theirs[:, 2]),
    ):
        assert ks_2samp(ours, reference).pvalue > 0.001
    for axis, extent, size in ((0, height, 2), (1, width, 3)):  # where the window sits, relative to its slack
        ours = boxes[:, axis] / np.maximum(extent - boxes[:, size], 1)
        reference = theirs[:, axis] / np.maximum(extent - theirs[:, size], 1)
        assert ks_2samp(ours, reference).pvalue > 0.001


def test_random_crop_and_flip_on_the_device_are_the_cpu_steps():
    images = np.random.default_rng(0).integers(0, 256, size=(16, 3, 32, 32), dtype=np.uint8)
    batch = {"image": images, "label": np.arange(16), ROW: np.arange(16) * 7}
    np.testing.assert_array_equal(
        on_device(RandomCrop(size=32, padding=4, seed=2), batch, epoch=1)["image"].numpy(),
        random_crop(batch, size=32, padding=4, seed=2, epoch=1)["image"],
    )
    flipped = on_device(RandomFlip(seed=2), batch, epoch=1)["image"].numpy()
    np.testing.assert_array_equal(flipped, random_flip(batch, seed=2, epoch=1)["image"])
    assert 0 < sum(not np.array_equal(a, b) for a, b in zip(flipped, images)) < 16


def test_encoded_images_decode_on_the_device_as_the_cpu_steps_decode_them():
    """JPEG bytes and a PNG in a Hugging Face struct: the validation decode (resize and centre crop) and the training
    crop from the bytes, decoded whole as on a GPU, against the CPU steps (which decode JPEGs at a DCT-reduced scale
    where the output allows: close, not equal); a CPU worker's crop is the CPU step's, pixel for pixel."""
    import io

    from PIL import Image

    pictures = [photo(300, 400, 1), photo(517, 389, 2), photo(260, 260, 3)]
    png = io.BytesIO()
    Image.fromarray(pictures[2]).save(png, format="PNG")
    column = np.array([jpeg(pictures[0]), jpeg(pictures[1]), {"bytes": png.getvalue(), "path": "p.png"}], dtype=object)
    batch = {"image": column, "label": np.arange(3), ROW: np.arange(3)}
    cpu = decode_image(batch, size=64, resize=72)["image"]
    device = on_device(DecodeImage(size=64, resize=72), batch, epoch=0)["image"].numpy()
    assert device.shape == cpu.shape and np.abs(device.astype(int) - cpu.astype(int)).mean() < 3
    cpu = random_resized_crop(batch, size=48, seed=4, flip=0.5)["image"]
    crop = RandomResizedCrop(size=48, seed=4, flip=0.5)
    np.testing.assert_array_equal(on_device(crop, batch, epoch=0)["image"].numpy(), cpu)  # a CPU worker's: the same
    params = crop.plan(batch, 0)  # a GPU's way, here on the CPU: each image decoded whole, then its window resized
    whole = resize_windows(decoded(column, 3, CPU), params["boxes"], params["flips"], 48).numpy()
    assert np.abs(whole.astype(int) - cpu.astype(int)).mean() < 4


def for_a_gpu(steps: list, epoch: int) -> Collate:
    """A collate as a GPU's worker makes it (ragged pixels padded into one tensor), unpinned: there is no GPU here."""
    collate = Collate(steps, epoch, torch.device("cuda:0"))
    collate.pin = False
    return collate


def test_ragged_pixels_reach_a_gpu_padded_and_the_cpu_as_they_are():
    batch = working_size(5)
    views = Collate([], 0, CPU)(batch).batch["image"]
    assert isinstance(views, Ragged) and [list(i.shape[1:]) for i in views.images] == views.sizes.tolist()
    assert all(np.shares_memory(tensor.numpy(), image) for tensor, image in zip(views.images, batch["image"]))
    padded = for_a_gpu([], 0)(batch).batch["image"]
    assert padded.images.shape[0] == 5 and padded.images.is_contiguous()
    for image, (h, w), pixels in zip(batch["image"], padded.sizes.tolist(), padded.images):
        assert image.shape[1:] == (h, w)
        np.testing.assert_array_equal(pixels[:, :h, :w].numpy(), image)
        assert not pixels[:, h:, :].any() and not pixels[:, :, w:].any()


def spec(cfg, split: str, name: str, **changes):
    return dataclasses.replace(cfg.transforms.active(split)[name], **changes)


def test_the_steps_that_run_every_epoch_go_to_the_device_where_auto_sends_them():
    """auto: on the device where the job sends such steps there (GPU workers, or a cache the workers read
    themselves) and the step has a device form; true: there anyway, with every step after it; false: in Ray Data's
    tasks, and then every step before it too."""
    cifar = compose_cfg([])
    crop, flip = spec(cifar, "train", "crop"), spec(cifar, "train", "flip")
    assert steps.device_split({"crop": crop, "flip": flip}, auto=False) == ({"crop": crop, "flip": flip}, {})
    assert steps.device_split({"crop": crop, "flip": flip}, auto=True) == ({}, {"crop": crop, "flip": flip})
    kept = dataclasses.replace(flip, on_device=False)
    assert steps.device_split({"crop": crop, "flip": kept}, auto=True) == ({"crop": crop, "flip": kept}, {})
    forced = dataclasses.replace(crop, on_device=True)
    assert steps.device_split({"crop": forced, "flip": flip}, auto=False) == ({}, {"crop": forced, "flip": flip})
    crop_only = dataclasses.replace(crop, on_device=False)
    assert steps.device_split({"crop": crop_only, "flip": flip}, auto=True) == ({"crop": crop_only}, {"flip": flip})

    photos = compose_cfg(["transforms=imagenet"])
    resized = spec(photos, "train", "crop")
    skipping = dataclasses.replace(resized, fn={**resized.fn, "on_error": "skip"})  # rows dropped: the CPU's work
    assert steps.device_split({"crop": skipping}, auto=True) == ({"crop": skipping}, {})
    once, every_epoch = steps.cached_steps(photos.transforms.active("train"))
    assert list(once) == ["decode"] and list(every_epoch) == ["crop"]
    decode = spec(photos, "valid", "decode", on_device=True)  # on the device: every epoch, not from the cache
    assert steps.cached_steps({"decode": decode}) == ({}, {"decode": decode})


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"train": {"flip": {"on_device": False}, "crop": {"on_device": True}}}, r"transforms\.train\.flip runs on"),
        ({"valid": {"decode": {"on_device": True, "fn": {"resize": 40, "size": None}}}}, "keep their different shapes"),
        ({"train": {"crop": {"on_device": True, "fn": {"unknown": 1}}}}, "does not take its arguments"),
    ],
)
def test_a_step_that_cannot_run_on_the_device_fails_before_ray_starts(changes, message):
    cfg = compose_cfg([])
    for split, named in changes.items():
        active = cfg.transforms.active(split)
        for name, change in named.items():
            fn = {**active[name].fn, **change.get("fn", {})}
            settings = {key: value for key, value in change.items() if key != "fn"}
            active[name] = dataclasses.replace(active[name], fn=fn, **settings)
        with pytest.raises(PipelineError, match=message):
            steps.check_device(split, active)


def test_a_function_without_a_device_form_named_when_put_there():
    step = steps.TransformSpec(fn={"_target_": "transforms.stack_features", "columns": ["a"]}, on_device=True)
    with pytest.raises(PipelineError, match=r"transforms\.train\.stack .*transforms\.stack_features has no device"):
        steps.check_device("train", {"stack": step})


def photo_run(tmp_path, name: str, overrides: list[str]) -> tuple[dict, dict]:
    """A short run on small photos at real sizes (the ImageNet steps at 32 pixels, one worker, rows in block order):
    its last epoch's metrics (with the weights' digest) and its tags."""
    from conftest import DETERMINISTIC, in_process

    from pipeline.tracking import mlflow_store

    photos = [
        "source=photos",
        f"source.root={tmp_path.parent / 'photos'}",
        "source.download.rows=160",
        "+source.download.files=2",
        "transforms=imagenet",
        "transforms.train.decode.fn.resize=40",
        "transforms.train.crop.fn.size=32",
        "transforms.valid.decode.fn.resize=40",
        "transforms.valid.decode.fn.size=32",
        *DETERMINISTIC,
        "train.epochs=1",
        "ingest.cache=true",  # cached though it is one epoch: the crops come from the cache's working size
        "tracking.log_model=false",
    ]
    metrics, run_dir = in_process(tmp_path, name, [*photos, *overrides])
    last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    client, _ = mlflow_store.connect(None, str(tmp_path / "outputs"))
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()], f"run_name = '{name}'")
    return {**metrics, "weights_sha256": last["ranks"][0]["weights_sha256"]}, run.data.tags


def test_a_run_with_its_crops_on_the_device_trains_the_weights_the_cpu_steps_train(tmp_path, ray_runtime):
    """Cached photos on one node, the crop on the device (here the worker's CPU, where on_device auto puts it for a
    cache the workers read themselves): the worker gathers the working size from the cache, cuts each row's
    window, and the run ends with the very weights of the run whose crops Ray Data's tasks cut (on_device=false).
    Streamed, the worker decodes the JPEG bytes itself (the validation split's too, on one node) and trains to about
    the same loss."""
    cpu, cpu_tags = photo_run(
        tmp_path / "cpu", "cpu", ["tracking.run_name=cpu", "transforms.train.crop.on_device=false"]
    )
    device, device_tags = photo_run(tmp_path / "device", "device", ["tracking.run_name=device"])
    assert "pipeline.device_steps" not in cpu_tags and device_tags["pipeline.device_steps"] == "train: crop"
    assert device["weights_sha256"] == cpu["weights_sha256"] and device["train_loss"] == cpu["train_loss"]
    streamed, streamed_tags = photo_run(
        tmp_path / "streamed",
        "streamed",
        ["tracking.run_name=streamed", "transforms.train.crop.on_device=true", "ingest.cache=false"],
    )
    assert streamed_tags["pipeline.device_steps"] == "train: crop; valid: decode"  # one node: the workers decode
    assert "not cached" in streamed_tags["pipeline.cache"]
    assert abs(streamed["train_loss"] - cpu["train_loss"]) < 0.1 * cpu["train_loss"]
