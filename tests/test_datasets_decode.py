"""Decoding: colour modes to RGB, reduced-size JPEG decoding."""

import numpy as np
import pytest
from PIL import Image

from pycls_fast.datasets.decode import (
    crop_flip_resize,
    crop_resize,
    draft_for,
    open_image,
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
    assert np.abs(arr.astype(int) - expected).max() <= 2


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
    # Same filter (a downscale and an upscale): rounding differences only.
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
