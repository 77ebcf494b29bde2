"""Each transform on hand-made batches, then the chain as Ray Data runs it (tasks and actors)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import capture_warnings, compose_cfg, epoch_dataset, in_block_order, jpeg, photo, write_split
from PIL import Image

from pipeline.common.errors import PipelineError
from transforms import decode_image, random_crop, random_flip, random_resized_crop
from transforms.tabular import stack_features


def images(n: int = 4, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(n, 3, 32, 32), dtype=np.uint8)


def test_decode_image_matches_pil_and_keeps_other_columns():
    pixels = np.random.default_rng(0).integers(0, 256, size=(3, 32, 32, 3), dtype=np.uint8)
    encoded = np.array([jpeg(p) for p in pixels], dtype=object)
    out = decode_image({"image": encoded, "label": np.array([1, 2, 3])})
    assert out["image"].shape == (3, 3, 32, 32) and out["image"].dtype == np.uint8
    np.testing.assert_array_equal(out["label"], [1, 2, 3])
    import io

    expected = np.stack([np.asarray(Image.open(io.BytesIO(b)).convert("RGB")) for b in encoded]).transpose(0, 3, 1, 2)
    # two JPEG decoders may round a few pixel values differently, never by much
    assert np.abs(out["image"].astype(int) - expected.astype(int)).max() <= 2


def test_decode_image_rejects_bytes_that_are_not_an_image():
    with pytest.raises(ValueError, match="'image'.*not an image that decodes"):
        decode_image({"image": np.array([b"not a jpeg"], dtype=object)})


def encoded(image: np.ndarray, fmt: str) -> bytes:
    import io

    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format=fmt)
    return buffer.getvalue()


def test_png_webp_gray_palette_and_rgba_decode_to_the_channels_asked_for():
    rgb = np.random.default_rng(3).integers(0, 256, size=(20, 24, 3), dtype=np.uint8)
    gray = rgb[..., 0]
    values = [
        encoded(rgb, "PNG"),
        encoded(gray, "PNG"),
        encoded(np.dstack([rgb, np.full((20, 24), 255, np.uint8)]), "PNG"),  # RGBA, opaque
        encoded(rgb, "WEBP"),
        encoded_palette(rgb),
    ]
    out = decode_image({"image": np.array(values, dtype=object)})
    assert out["image"].shape == (5, 3, 20, 24)
    np.testing.assert_array_equal(out["image"][0], rgb.transpose(2, 0, 1))  # PNG is lossless
    np.testing.assert_array_equal(out["image"][1], np.repeat(gray[None], 3, axis=0))  # gray -> RGB repeats it
    np.testing.assert_array_equal(out["image"][2], rgb.transpose(2, 0, 1))  # alpha dropped
    one = decode_image({"image": np.array(values[:3], dtype=object)}, channels=1)
    assert one["image"].shape == (3, 1, 20, 24)
    np.testing.assert_array_equal(one["image"][1, 0], gray)


def encoded_palette(rgb: np.ndarray) -> bytes:
    import io

    buffer = io.BytesIO()
    Image.fromarray(rgb).convert("P").save(buffer, format="PNG")
    return buffer.getvalue()


def test_hugging_face_structs_of_mixed_sizes_come_out_at_the_declared_size():
    """Hugging Face's parquet image layout: a struct {bytes, path} per row, PNG or JPEG, any size."""
    rng = np.random.default_rng(4)
    shapes = [(40, 60), (64, 32), (32, 32), (100, 80)]
    values = []
    for i, shape in enumerate(shapes):
        image = rng.integers(0, 256, (*shape, 3), dtype=np.uint8)
        values.append({"bytes": encoded(image, "PNG") if i % 2 else jpeg(image), "path": f"img{i}.png"})
    batch = {"image": np.array(values, dtype=object), "label": np.arange(4)}
    with pytest.raises(ValueError, match=r"mixes image sizes .*set size"):
        decode_image(batch)
    for fit in ("center_crop", "stretch"):
        out = decode_image(batch, size=24, fit=fit)
        assert out["image"].shape == (4, 3, 24, 24)
    # center_crop keeps the middle: a flat image with a bright centre band stays bright in the middle
    band = np.zeros((40, 80, 3), np.uint8)
    band[:, 30:50] = 255
    out = decode_image({"image": np.array([encoded(band, "PNG")], dtype=object)}, size=20)
    assert out["image"][0, :, :, 8:12].min() > 200 and out["image"][0, :, :, :3].max() < 30


def file_with_a_bad_row(tmp_path) -> dict:
    """A batch as the pipeline's reader yields it (with ``path``) from a file whose row 2 is not a JPEG."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    encoded = [jpeg(p.transpose(1, 2, 0)) for p in images(4)]
    encoded[2] = b"\xff\xd8 broken"
    path = str(tmp_path / "part-00007.parquet")
    pq.write_table(pa.table({"image": pa.array(encoded, pa.binary()), "label": list(range(4))}), path)
    return {"image": np.array(encoded, dtype=object), "label": np.arange(4), "path": np.array([path] * 4)}


def test_a_bad_row_is_named_by_file_and_row(tmp_path):
    with pytest.raises(
        ValueError,
        match=r"'image' row 2 of .*part-00007.parquet holds b'.*not an image that decodes.*on_error: skip",
    ):
        decode_image(file_with_a_bad_row(tmp_path))


def test_a_null_image_is_named_like_bad_bytes(tmp_path):
    """The decoder raises TypeError for a null: the row is bad all the same, and named."""
    batch = file_with_a_bad_row(tmp_path)
    batch["image"][2] = None
    with pytest.raises(
        ValueError, match=r"'image' in .*part-00007.parquet holds None, not an image that decodes \(TypeError"
    ):
        decode_image(batch)


def test_skipping_drops_only_the_bad_rows(tmp_path, caplog, monkeypatch):
    capture_warnings(caplog, monkeypatch, "transforms.image")
    out = decode_image(file_with_a_bad_row(tmp_path), on_error="skip")
    assert out["image"].shape == (3, 3, 32, 32)
    np.testing.assert_array_equal(out["label"], [0, 1, 3])  # every column lost the same row
    assert "skipped 1 of 4 rows" in caplog.text and "row 2 of" in caplog.text


def test_random_crop_without_padding_is_identity():
    batch = images()
    np.testing.assert_array_equal(random_crop({"image": batch}, padding=0)["image"], batch)


def test_random_crop_cuts_a_window_of_the_padded_image():
    batch = images(16)
    out = random_crop({"image": batch}, size=32, padding=4)["image"]
    assert out.shape == batch.shape
    padded = np.pad(batch, ((0, 0), (0, 0), (4, 4), (4, 4)))
    for original, cropped in zip(padded, out):
        windows = [
            (t, x) for t in range(9) for x in range(9) if np.array_equal(original[:, t : t + 32, x : x + 32], cropped)
        ]
        assert windows, "crop is not a window of the padded image"
    assert not all(np.array_equal(a, b) for a, b in zip(batch, out)), "16 crops all at the centre"


def test_random_flip_always_and_never():
    batch = images()
    np.testing.assert_array_equal(random_flip({"image": batch}, p=1.0)["image"], batch[..., ::-1])
    np.testing.assert_array_equal(random_flip({"image": batch}, p=0.0)["image"], batch)


@pytest.mark.parametrize("augment", [random_crop, random_flip])
def test_seeded_augmentation_depends_on_the_row_not_its_batch_or_order(augment):
    batch = images(32)
    once = augment({"image": batch}, seed=7)["image"]
    np.testing.assert_array_equal(augment({"image": batch}, seed=7)["image"], once)
    reordered = augment({"image": np.concatenate([batch[16:][::-1], batch[:16]])}, seed=7)["image"]
    np.testing.assert_array_equal(np.concatenate([once[16:][::-1], once[:16]]), reordered)
    np.testing.assert_array_equal(augment({"image": batch[5:9]}, seed=7)["image"], once[5:9])
    assert not np.array_equal(augment({"image": batch}, seed=8)["image"], once)
    assert sum(not np.array_equal(a, b) for a, b in zip(batch, once)) > 4  # the seed does not turn it off


RRC = {"scale": (0.08, 1.0), "ratio": (3 / 4, 4 / 3)}  # torchvision's RandomResizedCrop defaults


def torchvision_window(height: int, width: int, u: np.ndarray, scale, ratio) -> tuple[int, int, int, int]:
    """torchvision's ``RandomResizedCrop.get_params``, one image at a time, its random numbers taken from ``u`` (4 a
    try): the reference the vectorized windows are held to."""
    log_ratio = np.log(ratio)
    for a, b, c, d in u.reshape(10, 4):
        area = height * width * (scale[0] + a * (scale[1] - scale[0]))
        aspect = np.exp(log_ratio[0] + b * (log_ratio[1] - log_ratio[0]))
        w, h = round(np.sqrt(area * aspect)), round(np.sqrt(area / aspect))
        if 0 < w <= width and 0 < h <= height:
            return int(c * (height - h + 1)), int(d * (width - w + 1)), h, w
    in_ratio = width / height
    if in_ratio < min(ratio):
        w, h = width, round(width / min(ratio))
    elif in_ratio > max(ratio):
        h, w = height, round(height * max(ratio))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


@pytest.mark.parametrize(
    "scale, ratio", [((0.08, 1.0), (3 / 4, 4 / 3)), ((0.9, 1.0), (3.0, 4.0)), ((0.5, 1.0), (0.2, 0.25))]
)
def test_the_windows_are_torchvisions_for_the_same_random_numbers(scale, ratio):
    """crop_boxes draws every row's window at once; each is what torchvision's get_params picks for the same numbers,
    the fallback to the centre included (ratios no image here fits)."""
    from transforms.randomness import crop_boxes

    rng = np.random.default_rng(0)
    heights, widths = rng.integers(8, 600, 500), rng.integers(8, 600, 500)
    u = rng.random((500, 40))
    expected = [torchvision_window(h, w, row, scale, ratio) for h, w, row in zip(heights, widths, u)]
    np.testing.assert_array_equal(crop_boxes(heights, widths, u, scale, ratio), np.array(expected))


def test_validation_resize_and_center_crop_match_torchvision_on_mixed_sizes():
    """decode_image(size=224, resize=256) is torchvision's Resize(256) + CenterCrop(224), on any size,
    whether the JPEG is decoded at full size (small images) or at 1/2 scale (a 1200-pixel one)."""
    from torchvision.transforms import v2

    pictures = [photo(300, 400, 1), photo(517, 389, 2), photo(1200, 1000, 3)]
    values = [jpeg(p) for p in pictures[:2]] + [{"bytes": jpeg(pictures[2]), "path": "big.jpg"}]
    out = decode_image({"image": np.array(values, dtype=object)}, size=224, resize=256)["image"]
    assert out.shape == (3, 3, 224, 224) and out.dtype == np.uint8
    reference = v2.Compose([v2.Resize(256, antialias=True), v2.CenterCrop(224)])
    for got, picture in zip(out, pictures):
        expected = reference(torch.from_numpy(picture).permute(2, 0, 1)).numpy()
        assert np.abs(got.astype(int) - expected.astype(int)).mean() < 3  # JPEG and rounding, not a shifted window


def test_random_resized_crop_matches_torchvision_for_the_same_window():
    """The window is torchvision's (its get_params, fed our per-row numbers), cut and resized as its
    resized_crop does; a window at least twice the output is decoded at a DCT-reduced scale."""
    from torchvision.transforms.v2 import functional

    from transforms.image import resized_crop_plan

    pictures = [photo(375, 500, 4), photo(480, 360, 5), photo(1400, 1100, 6)]
    column = np.array([jpeg(p) for p in pictures], dtype=object)
    out = random_resized_crop({"image": column}, size=96, seed=11, epoch=3)["image"]
    assert out.shape == (3, 3, 96, 96) and out.dtype == np.uint8
    dims = np.array([p.shape[:2] for p in pictures])
    boxes, _ = resized_crop_plan(column, dims, **RRC, flip=0.0, seed=11, epoch=3, rows=None)
    for got, picture, (top, left, h, w) in zip(out, pictures, boxes):
        assert 0.08 * picture.shape[0] * picture.shape[1] <= h * w * 1.02 and 3 / 4 <= w / h * 1.02 <= 4 / 3 * 1.04
        image = torch.from_numpy(picture).permute(2, 0, 1)
        expected = functional.resized_crop(image, top, left, h, w, [96, 96], antialias=True).numpy()
        assert np.abs(got.astype(int) - expected.astype(int)).mean() < 4


def test_a_working_size_keeps_the_aspect_and_the_crop_takes_its_pixels_as_torchvision_would():
    """decode_image(resize=256) alone is torchvision's Resize(256): the shorter side 256, the aspect kept,
    a batch of mixed shapes as a ragged column (what ingest.cache keeps). random_resized_crop takes such
    pixels as it takes JPEGs: torchvision's window and resize, seeded per row and epoch, mirrored by flip."""
    from torchvision.transforms import v2
    from torchvision.transforms.v2 import functional

    from transforms.image import resized_crop_plan

    pictures = [photo(300, 400, 1), photo(517, 389, 2), photo(1200, 1000, 3), photo(256, 256, 4)[..., 0]]
    column = np.array([jpeg(p) for p in pictures], dtype=object)
    working = decode_image({"image": column, "label": np.arange(4)}, resize=256)
    shapes = [image.shape for image in working["image"]]
    assert working["image"].dtype == object and shapes == [(3, 256, 341), (3, 340, 256), (3, 307, 256), (3, 256, 256)]
    np.testing.assert_array_equal(working["label"], np.arange(4))
    for got, picture in zip(working["image"][:3], pictures):
        expected = v2.Resize(256, antialias=True)(torch.from_numpy(picture).permute(2, 0, 1)).numpy()
        assert got.dtype == np.uint8 and np.abs(got.astype(int) - expected.astype(int)).mean() < 3

    out = random_resized_crop(working, size=96, seed=11, epoch=3)["image"]
    assert out.shape == (4, 3, 96, 96) and out.dtype == np.uint8
    dims = np.array([image.shape[1:] for image in working["image"]])
    boxes, _ = resized_crop_plan(working["image"], dims, **RRC, flip=0.0, seed=11, epoch=3, rows=None)
    for got, pixels, (top, left, h, w) in zip(out, working["image"], boxes):
        expected = functional.resized_crop(torch.from_numpy(pixels), top, left, h, w, [96, 96], antialias=True)
        assert np.abs(got.astype(int) - expected.numpy().astype(int)).mean() < 1  # the same pixels: rounding only
    again = random_resized_crop({"image": working["image"][::-1].copy()}, size=96, seed=11, epoch=3)["image"]
    np.testing.assert_array_equal(again, out[::-1])  # a row's window depends on its pixels, not its batch
    assert not np.array_equal(random_resized_crop(working, size=96, seed=11, epoch=4)["image"], out)
    mirrored = random_resized_crop(working, size=96, seed=11, epoch=3, flip=1.0)["image"]
    np.testing.assert_array_equal(mirrored, out[..., ::-1])


def test_random_resized_crop_takes_gray_png_and_structs_and_is_seeded_per_row():
    gray = photo(200, 260, 7)[..., 0]
    values = [
        jpeg(photo(240, 320, 8)),
        encoded(gray, "PNG"),
        {"bytes": jpeg(gray), "path": "g.jpg"},
        jpeg(photo(333, 251)),
    ]
    column = np.array(values, dtype=object)
    once = random_resized_crop({"image": column, "label": np.arange(4)}, size=64, seed=5)
    assert once["image"].shape == (4, 3, 64, 64)
    np.testing.assert_array_equal(once["label"], np.arange(4))
    again = random_resized_crop({"image": column[::-1].copy()}, size=64, seed=5)["image"]
    np.testing.assert_array_equal(again, once["image"][::-1])  # a row's window does not depend on its batch
    other_epoch = random_resized_crop({"image": column}, size=64, seed=5, epoch=1)["image"]
    assert not np.array_equal(other_epoch, once["image"])
    assert random_resized_crop({"image": column}, size=64, channels=1)["image"].shape == (4, 1, 64, 64)
    with pytest.raises(ValueError, match=r"random_resized_crop: column 'image' holds b'not.*on_error: skip"):
        random_resized_crop({"image": np.array([b"not an image"], dtype=object)}, size=64)


def test_random_resized_crop_mirrors_the_window_it_would_cut_with_probability_flip():
    column = np.array([jpeg(photo(120 + 7 * i, 150, i)) for i in range(24)], dtype=object)
    plain = random_resized_crop({"image": column}, size=32, seed=2)["image"]
    always = random_resized_crop({"image": column}, size=32, flip=1.0, seed=2)["image"]
    np.testing.assert_array_equal(always, plain[..., ::-1])  # the same window, mirrored
    half = random_resized_crop({"image": column}, size=32, flip=0.5, seed=2)["image"]
    mirrored = [np.array_equal(h, a) and not np.array_equal(h, p) for h, a, p in zip(half, always, plain)]
    kept = [np.array_equal(h, p) for h, p in zip(half, plain)]
    assert all(m or k for m, k in zip(mirrored, kept)) and 4 <= sum(mirrored) <= 20
    np.testing.assert_array_equal(half, random_resized_crop({"image": column}, size=32, flip=0.5, seed=2)["image"])


def test_photos_are_written_offline_at_real_and_varied_sizes(tmp_path):
    import pyarrow.parquet as pq
    import simplejpeg

    from pipeline.data.datasets import write_photos

    write_photos(str(tmp_path), rows=60, files=3, gray_fraction=0.2)
    train, valid = pq.read_table(tmp_path / "photos" / "train"), pq.read_table(tmp_path / "photos" / "valid")
    assert (train.num_rows, valid.num_rows) == (60, 6) and len(list((tmp_path / "photos" / "train").glob("*"))) == 3
    assert sorted(np.bincount(train.column("label").to_numpy())) == [6] * 10  # 10 photographs, balanced
    headers = [simplejpeg.decode_jpeg_header(b) for b in train.column("image").to_pylist()]
    sizes = {(h, w) for h, w, *_ in headers}
    assert len(sizes) > 30 and all(256 <= min(s) <= 512 and max(s) <= 683 for s in sizes)
    assert 3 <= sum(colorspace == "Gray" for _, _, colorspace, _ in headers) <= 25


def test_seeded_augmentation_follows_the_training_epoch(tmp_path, ray_runtime):
    """Through the tasks that read each epoch's rows, as training runs them: the workers set the epoch on the
    job's epochs actor before each pass, and each of epochs 0, 1 and 2 flips a different set of rows; a second
    dataset built the same way flips the same sets, and one whose first pass is epoch 1 (a resumed run) repeats
    epoch 1."""
    import ray

    from pipeline.jobs import preflight

    write_split(tmp_path / "cifar10" / "train", 64, 2, seed=0)
    write_split(tmp_path / "cifar10" / "test", 16, 1, seed=1)
    cfg = compose_cfg([f"source.root={tmp_path}", "source.download=null"])
    split = preflight.sources(cfg)["train"]
    flip = cfg.transforms.train["flip"]
    split.steps = {
        "decode": cfg.transforms.train["decode"],
        "flip": dataclasses.replace(flip, fn={**flip.fn, "seed": 3}),
    }
    stored = pq.read_table(split.files)["image"].to_pylist()
    pixels = decode_image({"image": np.array(stored, dtype=object)})["image"]

    def passes(epochs: list[int]) -> list[list[int]]:
        """The rows each pass flipped (by their stored position: no shuffle, read in block order)."""
        flipped = []
        with in_block_order() as actor:
            ds = epoch_dataset(cfg, split, actor)
            for epoch in epochs:
                ray.get(actor.set_epoch.remote(epoch))
                out = [row["image"] for row in ds.take_all()]
                flipped.append([i for i, (o, p) in enumerate(zip(out, pixels)) if not np.array_equal(o, p)])
        return flipped

    epochs = passes([0, 1, 2])
    assert len({tuple(rows) for rows in epochs}) == 3 and all(epochs)  # three different sets of flips
    assert passes([0, 1]) == epochs[:2]
    assert passes([1]) == epochs[1:2]
    # the same rows a plain call with that epoch flips: the pipeline only supplies the epoch
    direct = random_flip({"image": pixels}, seed=3, epoch=2)["image"]
    assert [i for i in range(64) if not np.array_equal(direct[i], pixels[i])] == epochs[2]


def feed(cfg):
    """A CPU worker's feed of the validation split, no device step, no cache: Ray Data's shards only."""
    from pipeline.data.feed import Feed, Reading

    reading = Reading(epochs=None, on_device={"valid": {}}, indexed={}, columns=[], ingest=cfg.ingest, seed=0)
    return Feed(reading, torch.device("cpu"))


@pytest.mark.parametrize(
    "mean, std, expected",
    [((0.5,) * 3, (0.5,) * 3, [[-1.0, 1.0]] * 3), ((0.0, 0.5, 1.0), (1.0, 1.0, 2.0), [[0, 1], [-0.5, 0.5], [-0.5, 0]])],
)
def test_workers_turn_uint8_pixels_into_normalized_floats(ray_runtime, mean, std, expected):
    import ray.data

    from pipeline.training.scaling import feature_scaler

    pixels = np.array([[[[0, 255]]] * 3] * 5, dtype=np.uint8)  # (5, 3, 1, 2)
    ds = ray.data.from_items([{"image": p, "label": i} for i, p in enumerate(pixels)])
    cfg = compose_cfg(
        ["ingest.batch_size=2", f"ingest.normalize.mean={list(mean)}", f"ingest.normalize.std={list(std)}"]
    )
    out = list(feed(cfg).batches("valid", epoch=0, rank=0, world=1, training=False, shard=ds))
    assert sorted(len(b["label"]) for b in out) == [1, 2, 2]  # validation keeps its last partial batch
    raw = torch.cat([b["image"] for b in out])
    assert raw.dtype == torch.uint8 and torch.equal(raw, torch.from_numpy(pixels))  # scaled by the replica
    images = feature_scaler(cfg.ingest.normalize, None, torch.device("cpu"))(raw)
    assert images.dtype == torch.float32
    torch.testing.assert_close(images[:, :, 0], torch.tensor([expected] * 5, dtype=torch.float32))
    assert feature_scaler(None, None, torch.device("cpu"))(raw) is raw


def test_float_features_are_standardized_with_the_training_statistics(ray_runtime):
    """ingest.standardize: the statistics come from one pass over the training split, and workers apply
    them on the device; ingest.normalize (for uint8 pixels) leaves float features alone."""
    import ray.data

    from pipeline.data.preprocess import feature_statistics
    from pipeline.training.scaling import feature_scaler

    features = np.array([[1.0, 10.0], [3.0, 10.0], [5.0, 10.0], [7.0, 10.0]], dtype=np.float32)
    ds = ray.data.from_items([{"features": f, "label": i} for i, f in enumerate(features)])
    statistics = feature_statistics(ds, "features")
    np.testing.assert_allclose(statistics["mean"], [4.0, 10.0])
    np.testing.assert_allclose(statistics["std"], [np.sqrt(5.0), 1.0])  # a constant feature keeps std 1
    cfg = compose_cfg(["ingest.batch_size=4", "source.feature_column=features"])
    (batch,) = feed(cfg).batches("valid", epoch=0, rank=0, world=1, training=False, shard=ds)
    assert torch.equal(batch["features"], torch.from_numpy(features))  # scaled by the replica
    scaled = feature_scaler(cfg.ingest.normalize, statistics, torch.device("cpu"))(batch["features"])
    expected = (features - [4.0, 10.0]) / [np.sqrt(5.0), 1.0]
    torch.testing.assert_close(scaled, torch.tensor(expected, dtype=torch.float32))
    unscaled = feature_scaler(cfg.ingest.normalize, None, torch.device("cpu"))(batch["features"])
    assert torch.equal(unscaled, torch.from_numpy(features))  # normalize is for uint8 pixels only


def test_missing_nan_and_infinite_table_values_fail_naming_the_file_column_and_row_or_are_dropped_or_kept(tmp_path):
    """source.on_missing: raise (the default) names where the first bad value is; drop takes the row out;
    mean keeps it as NaN for training to fill in (a null list is a row of NaN, a value beyond float32 is inf)."""
    path = str(tmp_path / "part-00000.parquet")
    columns = {"mean radius": [1.0, 2.0, 3.0, 4.0], "mean texture": [1.0, None, 1e300, 4.0], "target": [0, 1, 0, 1]}
    pq.write_table(pa.table(columns), path)
    batch = {name: pa.table(columns)[name].to_numpy(zero_copy_only=False) for name in columns}
    batch["path"] = np.array([path] * 4)
    features = ["mean radius", "mean texture"]
    with pytest.raises(
        ValueError, match=rf"column 'mean texture' row 1 of {path} is missing, NaN or infinite \(2 such"
    ):
        stack_features(batch, features)
    dropped = stack_features(batch, features, on_missing="drop")
    assert dropped["target"].tolist() == [0, 1] and dropped["features"].tolist() == [[1.0, 1.0], [4.0, 4.0]]
    kept = stack_features(batch, features, on_missing="mean")["features"]
    assert np.isnan(kept[1:3, 1]).all() and np.isfinite(np.delete(kept, [3, 5])).all()
    lists = {"features": np.array([np.array([1.0, 2.0]), None], dtype=object), "target": np.array([1, 2])}
    assert np.isnan(stack_features(lists, ["features"], on_missing="mean")["features"][1]).all()


def test_statistics_skip_missing_values_and_a_feature_without_any_fails_naming_it(ray_runtime):
    """With source.on_missing: mean, the statistics are over the values present, and workers put the mean
    (0 once standardized) where a value is missing."""
    import ray.data

    from pipeline.data.preprocess import feature_statistics
    from pipeline.training.scaling import feature_scaler

    features = np.array([[1.0, np.nan], [3.0, np.nan], [np.nan, np.nan]], dtype=np.float32)
    ds = ray.data.from_items([{"features": f} for f in features])
    with pytest.raises(
        PipelineError, match="feature 1 of 'features' \\(column 'b'\\) has no finite mean and std .* from 0"
    ):
        feature_statistics(ds, "features", ["a", "b"])
    statistics = feature_statistics(ds.map(lambda row: {"features": row["features"][:1]}), "features")
    assert statistics == {"mean": [2.0], "std": [1.0]}
    scaled = feature_scaler(None, statistics, torch.device("cpu"))(torch.tensor([[3.0], [float("nan")]]))
    assert scaled.tolist() == [[1.0], [0.0]]


class AddConstant:
    """A class transform: the pipeline runs it as an actor pool."""

    def __init__(self, value: float):
        self.value = value

    def __call__(self, batch):
        return {**batch, "image": batch["image"] + self.value}


SHIFTED = """# @package _global_
transforms:
  valid:
    shift:
      fn: {_target_: test_transforms.AddConstant, value: 10}
      concurrency: 1
"""


def test_configured_chain_runs_lazily_on_ray_data(ray_runtime, tmp_path):
    """An experiment file adds a class step to the valid chain; Ray Data runs it as an actor."""
    import sys

    import ray.cloudpickle
    import ray.data

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray workers cannot import tests/

    from pipeline.data import steps

    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "shifted.yaml").write_text(SHIFTED)
    cfg = compose_cfg([f"hydra.searchpath=[file://{tmp_path}]", "+experiment=shifted"])
    assert list(cfg.transforms.valid) == ["decode", "shift"]
    pixels = np.random.default_rng(1).integers(0, 256, size=(6, 32, 32, 3), dtype=np.uint8)
    ds = ray.data.from_items([{"image": jpeg(p), "label": i} for i, p in enumerate(pixels)])
    rows = steps.apply(ds, cfg.transforms.valid, ["image", "label"]).take_all()
    out = sorted(rows, key=lambda row: row["label"])  # a pool of actors may return batches out of order
    decoded = decode_image({"image": np.array([jpeg(p) for p in pixels], dtype=object)})
    expected = decoded["image"] + 10
    np.testing.assert_array_equal(np.stack([row["image"] for row in out]), expected)
    assert [row["label"] for row in out] == list(range(6))


STEPS = "MapBatches(decode_image)->MapBatches(random_crop)->MapBatches(random_flip)->Project"


@pytest.mark.parametrize(
    "files, task_per_file, operators",
    [
        (2, True, [f"ReadParquet->{STEPS}: 2 tasks"]),  # the read and every step fused: one task per file
        (1, True, ["ReadParquet: 1 tasks", "Repartition", f"{STEPS}: 2 tasks"]),  # one file, still 2 at once
        (1, False, ["ReadParquet->SplitBlocks", f"{STEPS}: 4 tasks"]),  # Ray splits the blocks itself
    ],
)
def test_a_split_is_transformed_in_one_task_per_file_and_never_fewer_than_the_cpus(
    ray_runtime, tmp_path, files, task_per_file, operators
):
    """With source.task_per_file and whole-block steps Ray Data fuses the read and every step into one
    task per file; a split of fewer files than CPUs (2 here) is spread over one block per CPU first."""
    from pipeline.data import preprocess, source

    write_split(tmp_path / "cifar10" / "train", 64, files, seed=0)
    write_split(tmp_path / "cifar10" / "test", 16, 1, seed=0)
    cfg = compose_cfg([f"source.root={tmp_path}", "source.download=null", f"source.task_per_file={task_per_file}"])
    split = source.prepare(cfg.source)["train"]
    ds = preprocess.dataset(split, cfg.transforms.train, ["image", "label"], cfg.source)
    rows = ds.take_all()
    assert len(rows) == 64 and rows[0]["image"].dtype == np.uint8
    executed = [line.split(" ", 2)[2] for line in ds.stats().splitlines() if line.startswith("Operator ")]
    assert len(executed) == len(operators) and all(e.startswith(o) for e, o in zip(executed, operators)), executed


def test_the_modules_ray_tasks_import_leave_torch_and_mlflow_out():
    """A new Ray task or actor process imports these to unpickle what it runs (Ray Data's read tasks and steps, the
    cache's pieces, the job's epochs actor, the event queue, the report relay); torch or MLflow among
    their imports would delay every such process by seconds: a run's start-up and its first epoch's data wait."""
    import subprocess
    import sys

    modules = (
        "pipeline.data.preprocess, pipeline.data.steps, pipeline.data.cache, pipeline.data.epochs, "
        "pipeline.data.pieces, pipeline.training.events, pipeline.training.relay, "
        "transforms"
    )
    code = f"import sys, {modules}; print(sorted(m for m in ('torch', 'mlflow', 'matplotlib') if m in sys.modules))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]"
