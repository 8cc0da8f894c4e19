"""pixel_ops against Pillow: every op, at every magnitude timm maps to an argument,
gives Pillow's pixels exactly (the ops are table lookups, integer functions or
Pillow's float32 blend repeated in the same order)."""

import random
from unittest import mock

import numpy as np
import pytest
import torch
from PIL import Image, ImageEnhance, ImageFilter, ImageOps
from timm.data import auto_augment as timm_aa

from pycls_fast.datasets.images import pixel_ops
from pycls_fast.datasets.images.policies import OPS


def _photo(h, w, seed):
    """A gradient with noise: many distinct values, smooth and sharp neighbours."""
    rng = np.random.default_rng(seed)
    base = np.linspace(0, 255, w * h * 3).reshape(h, w, 3)
    return np.clip(base + rng.integers(-60, 60, (h, w, 3)), 0, 255).astype(np.uint8)


IMAGES = {
    "photo": _photo(24, 32, 0),
    "noise": np.random.default_rng(1).integers(0, 256, (17, 23, 3)).astype(np.uint8),
    "flat": np.full((6, 7, 3), 77, np.uint8),  # one value: the tables' special cases
    "two_values": (np.random.default_rng(2).integers(0, 2, (9, 8, 3)) * 255).astype(
        np.uint8
    ),
    "dark": np.random.default_rng(3).integers(0, 9, (12, 10, 3)).astype(np.uint8),
}
# timm's magnitudes 0-10 and AugReg's mmax 15.
LEVELS = [0, 2.5, 5, 7.3, 9, 10, 15]
POINT_OPS = [
    name
    for name in OPS
    if name
    not in {"Rotate", "ShearX", "ShearY", "TranslateX", "TranslateY"}
    | {"TranslateXRel", "TranslateYRel", "GaussianBlurRand"}
]


def _equal(pil_image, tensor):
    assert tensor.dtype == torch.uint8
    np.testing.assert_array_equal(tensor.numpy(), np.asarray(pil_image))


def _timm_posterize(img, bits, **_):
    # Pillow 13 refuses 0 bits; earlier Pillow's table was i & ~255 = 0 for every i.
    if bits <= 0:
        return Image.new(img.mode, img.size, 0)
    return timm_aa.posterize(img, bits)


@pytest.mark.parametrize("name", POINT_OPS)
def test_each_op_at_each_magnitude_is_pillows(name):
    level_fn, op = OPS[name]
    timm_op = _timm_posterize if name.startswith("Posterize") else None
    timm_op = timm_op or timm_aa.NAME_TO_OP[name]
    cases = set()
    for level in LEVELS if level_fn else [0]:
        for sign in (0.25, 0.75):  # both signs where timm negates
            rng = mock.Mock(random=mock.Mock(return_value=sign))
            with mock.patch.object(timm_aa.random, "random", return_value=sign):
                args = timm_aa.LEVEL_TO_ARG[name](level, {}) if level_fn else ()
            assert (level_fn(level, {}, rng) if level_fn else ()) == args
            cases.add(args)
    for arr in IMAGES.values():
        im, t = Image.fromarray(arr), torch.from_numpy(arr.copy())
        for args in cases:
            _equal(timm_op(im, *args), op(t, *args, 3, (124, 116, 104), None))
            assert torch.equal(t, torch.from_numpy(arr)), "the input was modified"


def test_level_args_follow_timms_signs():
    for name in ("Rotate", "ShearX", "TranslateXRel", "ColorIncreasing"):
        level_fn = OPS[name][0]
        for draw, sign in ((0.25, 1), (0.75, -1)):
            rng = mock.Mock(random=mock.Mock(return_value=draw))
            with mock.patch.object(timm_aa.random, "random", return_value=draw):
                want = timm_aa.LEVEL_TO_ARG[name](7, {"translate_const": 100})
            assert level_fn(7, {"translate_const": 100}, rng) == want, (name, sign)


@pytest.mark.parametrize("image", ["photo", "noise"])
def test_blends_match_imageenhance_at_many_factors(image):
    arr = IMAGES[image]
    im, t = Image.fromarray(arr), torch.from_numpy(arr)
    rng = random.Random(0)
    factors = [0.0, 1.0, 0.5, 2.0] + [rng.uniform(0, 2.5) for _ in range(16)]
    for f in factors:
        _equal(ImageEnhance.Brightness(im).enhance(f), pixel_ops.brightness(t, f))
        _equal(ImageEnhance.Contrast(im).enhance(f), pixel_ops.contrast(t, f))
        _equal(ImageEnhance.Color(im).enhance(f), pixel_ops.color(t, f))
        _equal(ImageEnhance.Sharpness(im).enhance(f), pixel_ops.sharpness(t, f))


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_luma_blur_and_tables_are_pillows(image):
    arr = IMAGES[image]
    im, t = Image.fromarray(arr), torch.from_numpy(arr)
    gray = im.convert("L")
    _equal(Image.merge("RGB", (gray, gray, gray)), pixel_ops.grayscale(t))
    _equal(ImageOps.autocontrast(im), pixel_ops.autocontrast(t))
    _equal(ImageOps.equalize(im), pixel_ops.equalize(t))
    for radius in (0.1, 0.37, 1.0, 1.5, 2.0, 3.3):  # box radii 0, 1 and 2
        _equal(
            im.filter(ImageFilter.GaussianBlur(radius)),
            pixel_ops.gaussian_blur(t, radius),
        )
    for threshold in (0, 1, 100, 128, 255, 256):
        _equal(ImageOps.solarize(im, threshold), pixel_ops.solarize(t, threshold))
    for add, threshold in ((40, 128), (200, 128), (30, 256), (0, 128)):
        _equal(
            timm_aa.solarize_add(im, add, threshold),
            pixel_ops.solarize_add(t, add, threshold),
        )


def test_equalize_table_values_past_255_are_clipped_as_pillow_clips_them():
    # step = (N - last) // 255 with a large remainder: Pillow's table reaches 256 at
    # the top value and its 8-bit `point` clips it to 255.
    arr = np.zeros((1, 300, 3), np.uint8)
    arr[0, 10:290] = (np.arange(280) % 254 + 1)[:, None]
    arr[0, 290:] = 255
    counts = np.bincount(arr[0, :, 0], minlength=256)
    step = (300 - counts[255]) // 255
    assert (step // 2 + counts[:255].sum()) // step > 255  # the table passes 255
    im, t = Image.fromarray(arr), torch.from_numpy(arr)
    _equal(ImageOps.equalize(im), pixel_ops.equalize(t))


def test_posterize_zero_bits_clears_every_bit():
    """Pillow 13's ImageOps.posterize raises for 0 bits; the table earlier Pillow
    built for it (i & ~(2^8 - 1)) cleared every bit."""
    t = torch.from_numpy(IMAGES["photo"])
    assert torch.equal(pixel_ops.posterize(t, 0), torch.zeros_like(t))
    assert torch.equal(pixel_ops.posterize(t, -2), torch.zeros_like(t))  # mmax 15
    assert torch.equal(pixel_ops.posterize(t, 8), t)
    with pytest.raises(ValueError):
        ImageOps.posterize(Image.fromarray(IMAGES["photo"]), 0)
