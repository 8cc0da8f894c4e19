"""Decoding: the direct JPEG path, colour modes to RGB, reduced-size JPEG decoding."""

import io
import math
import os
import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image, UnidentifiedImageError

from pycls_fast.datasets.images.decode import (
    EncodedImage,
    crop_flip_resize,
    crop_resize,
    decode_jpeg_rgbx,
    draft_for,
    draft_scale,
    jpeg_rgb_size,
    open_image,
    resize_crop_into,
    to_rgb,
)


def _save(tmp_path, im, name, **kw):
    path = str(tmp_path / name)
    im.save(path, **kw)
    return path


@pytest.mark.parametrize(
    "mode,name,value",
    [
        ("L", "gray.jpg", 100),
        ("RGBA", "alpha.png", (10, 200, 30, 128)),
        ("CMYK", "cmyk.jpg", (0, 0, 0, 0)),
        ("LA", "gray_alpha.png", (77, 9)),
        ("I;16", "deep.png", 200 * 256),
    ],
)
@pytest.mark.parametrize("resize", [crop_resize, crop_flip_resize])
def test_modes_become_rgb(tmp_path, mode, name, value, resize):
    path = _save(tmp_path, Image.new(mode, (24, 16), value), name)
    with open_image(path) as im:
        out = resize(im, (0, 0, 24, 16), (8, 8))
    arr = np.asarray(out)
    assert arr.shape == (8, 8, 3) and arr.dtype == np.uint8
    expected = {
        "L": (100, 100, 100),
        "RGBA": (10, 200, 30),  # alpha dropped
        "CMYK": (255, 255, 255),  # no ink is white
        "LA": (77, 77, 77),
        "I;16": (200, 200, 200),  # top 8 bits of 16
    }[mode]
    # Lossless files of one value: only the resize's fixed-point weights (summing to
    # 1 within their precision) and its rounding to uint8 stand between: 1 level.
    assert np.abs(arr.astype(int) - expected).max() <= 1


def test_palette_with_transparency(tmp_path):
    im = Image.new("P", (8, 8), 1)
    im.putpalette([0, 0, 0, 250, 20, 20] + [0] * 762)
    im.info["transparency"] = 0
    path = _save(tmp_path, im, "pal.png")
    with open_image(path) as im:
        arr = np.asarray(to_rgb(im))
    assert arr.shape == (8, 8, 3) and tuple(arr[0, 0]) == (250, 20, 20)


def test_jpeg_draft_reduces_decode_size_and_keeps_content(tmp_path):
    x = np.linspace(0, 255, 800)[None, :, None].repeat(600, 0).repeat(3, 2)
    path = _save(tmp_path, Image.fromarray(x.astype(np.uint8)), "big.jpg", quality=95)
    with open_image(path) as im:
        box = draft_for(im, (0, 0, 800, 600), (64, 48))
        assert im.size == (100, 75)  # 1/8 scale still >= 64x48
        assert box == (0, 0, 100, 75)
    with open_image(path) as im:
        fast = np.asarray(crop_resize(im, (200, 150, 600, 450), (64, 48))).astype(int)
    full = (
        Image.open(path)
        .convert("RGB")
        .resize((64, 48), Image.BILINEAR, box=(200, 150, 600, 450))
    )
    assert np.abs(fast - np.asarray(full).astype(int)).mean() < 3


def test_draft_skipped_when_crop_is_small(tmp_path):
    path = _save(tmp_path, Image.new("RGB", (200, 150), (5, 6, 7)), "s.jpg")
    with open_image(path) as im:
        assert draft_for(im, (0, 0, 50, 50), (64, 64)) == (0, 0, 50, 50)
        assert im.size == (200, 150)


def _photo(tmp_path, w=300, h=200):
    """A PNG (no JPEG draft: the same pixels as the reference) with texture at every
    scale: smooth gradients plus noise."""
    rng = np.random.default_rng(0)
    x = np.linspace(0, 1, w)[None, :, None]
    y = np.linspace(0, 1, h)[:, None, None]
    arr = 255 * (0.5 + 0.25 * np.sin(9 * x + 5 * y + np.arange(3)))
    arr = np.clip(arr + rng.normal(0, 20, (h, w, 3)), 0, 255)
    return _save(tmp_path, Image.fromarray(arr.astype(np.uint8)), "photo.png")


@pytest.mark.parametrize(
    "box,size", [((17, 9, 190, 150), (64, 48)), ((40, 30, 90, 70), (96, 96))]
)
def test_crop_flip_resize_is_pillow_bilinear_on_the_crop(tmp_path, box, size):
    path = _photo(tmp_path)
    with open_image(path) as im:
        out = crop_flip_resize(im, box, size)
    assert out.shape == (size[1], size[0], 3) and out.dtype == np.uint8
    assert out.flags["C_CONTIGUOUS"]
    ref = Image.open(path).convert("RGB").crop(box).resize(size, Image.BILINEAR)
    # Same filter (a downscale and an upscale): each side rounds the same value to
    # uint8 (1/2 level, plus fixed-point error under 1/2): at most 1 level apart.
    assert np.abs(out.astype(int) - np.asarray(ref).astype(int)).max() <= 1
    with open_image(path) as im:
        mirrored = crop_flip_resize(im, box, size, flip=True)
    np.testing.assert_array_equal(mirrored, out[:, ::-1])


def test_crop_flip_resize_rounds_fractional_boxes_and_uses_the_draft(tmp_path):
    x = np.linspace(0, 255, 800)[None, :, None].repeat(600, 0).repeat(3, 2)
    path = _save(tmp_path, Image.fromarray(x.astype(np.uint8)), "big.jpg", quality=95)
    box = (200.4, 150.6, 600.2, 450.3)
    with open_image(path) as im:
        fast = crop_flip_resize(im, box, (64, 48)).astype(int)
        assert im.size == (200, 150)  # decoded at 1/4 scale, crop still >= 64x48
    full = Image.open(path).convert("RGB").resize((64, 48), Image.BILINEAR, box=box)
    assert np.abs(fast - np.asarray(full).astype(int)).mean() < 3


def _jpeg_bytes(arr, **kw):
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="JPEG", **kw)
    return buf.getvalue()


def _noise(h, w, seed=0):
    """Smooth colours plus noise: JPEG blocks of every kind."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    base = 128 + 80 * np.sin(x[..., None] / 17 + y[..., None] / 23 + np.arange(3))
    return np.clip(base + rng.normal(0, 25, (h, w, 3)), 0, 255).astype(np.uint8)


@pytest.mark.parametrize(
    "kw", [{}, {"progressive": True}, {"subsampling": 0}, {"quality": 40}]
)
def test_jpeg_rgb_size_reads_rgb_jpeg_headers(kw):
    data = _jpeg_bytes(_noise(37, 53), **kw)
    assert jpeg_rgb_size(data) == (53, 37)


def test_jpeg_rgb_size_declines_what_pillow_must_handle(tmp_path):
    gray = _jpeg_bytes(_noise(8, 8)[..., 0])
    cmyk = io.BytesIO()
    Image.new("CMYK", (8, 8)).save(cmyk, format="JPEG")
    png = io.BytesIO()
    Image.new("RGB", (8, 8)).save(png, format="PNG")
    rgb = _jpeg_bytes(_noise(8, 8))
    for data in (gray, cmyk.getvalue(), png.getvalue(), b"", b"\xff\xd8", rgb[:20]):
        assert jpeg_rgb_size(data) is None
    # Random bytes after a JPEG signature never raise.
    rng = np.random.default_rng(0)
    for _ in range(300):
        tail = rng.integers(0, 256, rng.integers(0, 64), dtype=np.uint8).tobytes()
        size = jpeg_rgb_size(b"\xff\xd8" + tail)
        assert size is None or (size[0] > 0 and size[1] > 0)


@pytest.mark.parametrize("scale", [1, 2, 4, 8])
def test_decode_jpeg_rgbx_equals_pillow_at_every_dct_scale(scale):
    data = _jpeg_bytes(_noise(75, 101), progressive=scale == 2)
    ref = Image.open(io.BytesIO(data))
    if scale > 1:
        ref.draft("RGB", (101 // scale, 75 // scale))
    ref = np.asarray(ref.convert("RGB"))
    rgbx = decode_jpeg_rgbx(data, (101, 75), scale)
    assert rgbx.shape == (-(-75 // scale), -(-101 // scale), 4) == (*ref.shape[:2], 4)
    np.testing.assert_array_equal(rgbx[..., :3], ref)
    assert (rgbx[..., 3] == 255).all()


def test_decode_jpeg_rgbx_fails_where_pillow_fails_and_agrees_elsewhere():
    data = _jpeg_bytes(_noise(64, 64))
    half = len(data) // 2
    early_end = data[:half] + b"\xff\xd9"  # libjpeg warns and fills the rest: kept
    garbled = bytearray(data)
    noise = np.random.default_rng(0).integers(0, 256, 300, np.uint8)
    garbled[300:600] = noise.tobytes()
    with pytest.raises(OSError, match="truncated"):
        decode_jpeg_rgbx(data[:half], (64, 64))
    for damaged in (early_end, bytes(garbled)):
        try:
            with Image.open(io.BytesIO(damaged)) as im:
                ref = np.asarray(im.convert("RGB"))
        except (OSError, SyntaxError):
            with pytest.raises(OSError):
                decode_jpeg_rgbx(damaged, (64, 64))
        else:
            rgbx = decode_jpeg_rgbx(damaged, (64, 64))
            np.testing.assert_array_equal(rgbx[..., :3], ref)


def test_decode_buffer_is_reused_within_a_thread_and_private_to_it():
    data = _jpeg_bytes(_noise(30, 40))
    first = decode_jpeg_rgbx(data, (40, 30))
    again = decode_jpeg_rgbx(data, (40, 30))
    assert np.shares_memory(first, again)
    other = []
    thread = threading.Thread(
        target=lambda: other.append(decode_jpeg_rgbx(data, (40, 30)))
    )
    thread.start()
    thread.join()
    assert not np.shares_memory(first, other[0])
    np.testing.assert_array_equal(first, other[0])


def test_draft_scale_is_pillows_choice():
    rng = np.random.default_rng(1)
    tiny = _jpeg_bytes(_noise(8, 8))
    for _ in range(300):
        w, h = (int(v) for v in rng.integers(20, 3000, 2))
        cw, ch = (max(1, int(v * f)) for v, f in zip((w, h), rng.uniform(0.05, 1, 2)))
        box, out = (0, 0, cw, ch), (int(rng.integers(8, 300)),) * 2
        scale = draft_scale((w, h), box, out)
        # Pillow's own choice for the smallest decode that keeps the crop >= out.
        want = (math.ceil(w * out[0] / cw), math.ceil(h * out[1] / ch))
        for request in (want, None):
            # A JPEG whose header claims w x h: Pillow's draft only reads size, tile.
            im = Image.open(io.BytesIO(tiny))
            im._size, im.tile = (w, h), [im.tile[0]._replace(extents=(0, 0, w, h))]
            if request is None:
                draft_for(im, box, out)
            elif want[0] <= w and want[1] <= h:
                im.draft("RGB", want)
            assert im.size == (-(-w // scale), -(-h // scale)), (w, h, box, out)
        # The crop, decoded at that scale, still has at least out_size pixels.
        assert scale == 1 or (cw / scale >= out[0] and ch / scale >= out[1])


@pytest.mark.parametrize("size", [(500, 375), (1700, 1100)])
def test_direct_jpeg_path_equals_the_pillow_path(size):
    data = _jpeg_bytes(_noise(size[1], size[0]))
    image = EncodedImage(data)
    assert image.direct and image.size == size
    rng = np.random.default_rng(2)
    scales = set()
    for _ in range(12):
        cw, ch = (int(v * f) for v, f in zip(size, rng.uniform(0.1, 1, 2)))
        left, top = int(rng.integers(0, size[0] - cw + 1)), int(rng.integers(0, 4))
        box, flip = (left, top, left + cw, top + ch), bool(rng.integers(2))
        scales.add(draft_scale(size, box, (64, 64)))
        out = np.empty((64, 64, 3), dtype=np.uint8)
        image.crop_flip_resize_into(box, out, flip)
        with Image.open(io.BytesIO(data)) as im:
            ref = crop_flip_resize(im, box, (64, 64), flip)
        np.testing.assert_array_equal(out, ref)
    assert len(scales) > 1  # Both full-size and reduced (DCT-scaled) decodes ran.


def test_encoded_image_falls_back_to_pillow_for_other_files(tmp_path):
    path = _save(tmp_path, Image.new("L", (30, 20), 90), "gray.jpg")
    image = EncodedImage.read(path)
    assert not image.direct and image.size == (30, 20)
    out = np.empty((8, 8, 3), dtype=np.uint8)
    image.crop_flip_resize_into((0, 0, 30, 20), out)
    # Flat gray JPEG (quality 75, DC step 8): <= 8 / 16 in the mean, 1/2 each for the
    # encoder's and the IDCT's roundings, and the resize's rounding (1): 2 levels.
    assert np.abs(out.astype(int) - 90).max() <= 2
    with pytest.raises(UnidentifiedImageError):
        EncodedImage(b"not an image at all")


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")
def test_resize_starts_no_threads():
    # Intra-op threads started from a loader thread oversubscribe the cores, and an
    # OpenMP pool hangs processes forked later (the DataLoader's workers).
    data = _jpeg_bytes(_noise(375, 500))
    out = np.empty((224, 224, 3), dtype=np.uint8)
    before, during = len(os.listdir("/proc/self/task")), []

    def decode():
        for flip in (False, True):
            EncodedImage(data).crop_flip_resize_into((41, 30, 437, 333), out, flip)
        # Counted while this thread lives: an OpenMP team it started lives as long.
        during.append(len(os.listdir("/proc/self/task")))

    thread = threading.Thread(target=decode)
    thread.start()
    thread.join()
    assert during == [before + 1]


@pytest.mark.parametrize("flip", [False, True])
def test_resize_crop_into_equals_torch_interpolate_on_the_crop(flip):
    rgbx = np.concatenate([_noise(90, 120), np.full((90, 120, 1), 255, np.uint8)], 2)
    box = (13.4, 7.6, 101.2, 80.5)  # Rounded to (13, 8, 101, 80).
    out = np.empty((48, 40, 3), dtype=np.uint8)
    resize_crop_into(rgbx, box, out, flip)
    crop = torch.from_numpy(np.ascontiguousarray(rgbx[8:80, 13:101, :3]))
    ref = F.interpolate(
        crop.permute(2, 0, 1)[None].float(),
        size=(48, 40),
        mode="bilinear",
        antialias=True,
    )
    ref = ref[0].permute(1, 2, 0).round().clamp(0, 255).to(torch.uint8).numpy()
    if flip:
        ref = ref[:, ::-1]
    # torch's uint8 kernel computes in fixed point: within one level of the float one.
    assert np.abs(out.astype(int) - ref.astype(int)).max() <= 1
    exact = F.interpolate(
        crop.permute(2, 0, 1)[None], size=(48, 40), mode="bilinear", antialias=True
    )[0].permute(1, 2, 0)
    np.testing.assert_array_equal(out, exact.numpy()[:, ::-1] if flip else exact)
