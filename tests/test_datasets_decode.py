"""Decoding: colour modes to RGB, reduced-size JPEG decoding."""

import numpy as np
import pytest
from PIL import Image

from pycls_fast.datasets.decode import crop_resize, draft_for, open_image, to_rgb


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
def test_modes_become_rgb(tmp_path, mode, name, value):
    path = _save(tmp_path, Image.new(mode, (24, 16), value), name)
    with open_image(path) as im:
        out = crop_resize(im, (0, 0, 24, 16), (8, 8))
    arr = np.asarray(out)
    assert out.mode == "RGB" and arr.shape == (8, 8, 3)
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
