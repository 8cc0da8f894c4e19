"""geometry_ops against Pillow's affine transform (bilinear and bicubic, fill colour).

Rotations and general matrices run Pillow's own transform: the same pixels exactly.
Shears and translations are torch ops: `_pillow_values` repeats Pillow's Geometry.c in
float64 (its source points, its filled pixels, its BILINEAR / BICUBIC macros in their
order) and is checked to give Pillow's image exactly; the ops interpolate in float32,
and the bound on their distance from Pillow's double value (`eps`, derived below)
means an output pixel may differ from Pillow's by 1, and only where Pillow's value
lies within it of an integer; filled pixels are the same.
"""

import random

import numpy as np
import pytest
import torch
from PIL import Image
from timm.data import auto_augment as timm_aa

from pycls_fast.datasets.images import geometry_ops as geometry

FILL = (124, 116, 104)
U32 = 2.0**-24  # float32 unit roundoff


def eps() -> float:
    """Largest distance of a shear's or translation's float32 value from Pillow's
    float64 one: each of at most 4 weights (whose magnitudes sum to at most 1.5:
    bicubic a = -1 at d = 0.5) is rounded once to float32, and the 4 products and 3
    sums of taps up to 255 once each: at most (4 + 7) roundings of 255 x 1.5."""
    return (4 + 7) * 255 * 1.5 * U32


def _photo(h, w, seed):
    rng = np.random.default_rng(seed)
    base = np.linspace(0, 255, w * h * 3).reshape(h, w, 3)
    return np.clip(base + rng.integers(-60, 60, (h, w, 3)), 0, 255).astype(np.uint8)


def _bicubic_1d(v1, v2, v3, v4, d):
    """Geometry.c's BICUBIC macro, operation for operation."""
    p1 = v2
    p2 = -v1 + v3
    p3 = 2 * (v1 - v2) + v3 - v4
    p4 = -v1 + v2 - v3 + v4
    return p1 + d * (p2 + d * (p3 + d * p4))


def _pillow_values(arr, matrix, resample):
    """Pillow's value of every output pixel before truncation (float64 (h, w, 3)), and
    the mask of the pixels it fills instead."""
    h, w = arr.shape[:2]
    a, b, c, d, e, f = matrix
    xc = np.arange(w) + 0.5
    yc = np.arange(h)[:, None] + 0.5
    xin = (a * xc + b * yc) + c
    yin = (d * xc + e * yc) + f
    filled = ~((xin >= 0) & (xin < w) & (yin >= 0) & (yin < h))
    xs, ys = xin - 0.5, yin - 0.5
    x, y = np.floor(xs), np.floor(ys)
    dx, dy = (xs - x)[..., None], (ys - y)[..., None]
    x, y = x.astype(int), y.astype(int)
    src = arr.astype(np.float64)

    def at(r, xx):
        return src[r, np.clip(xx, 0, w - 1)]

    if resample == geometry.BILINEAR:
        r0 = np.clip(y, 0, h - 1)
        v1 = at(r0, x) + (at(r0, x + 1) - at(r0, x)) * dx
        ok = ((y + 1 >= 0) & (y + 1 < h))[..., None]
        r1 = np.clip(y + 1, 0, h - 1)
        v2 = np.where(ok, at(r1, x) + (at(r1, x + 1) - at(r1, x)) * dx, v1)
        value = v1 + (v2 - v1) * dy
    else:
        x, y = x - 1, y - 1
        rows = []
        for k in range(4):
            r = np.clip(y + k, 0, h - 1)
            v = _bicubic_1d(*(at(r, x + i) for i in range(4)), dx)
            if k:  # Pillow: a row past the edge repeats the previous row's value
                ok = ((y + k >= 0) & (y + k < h))[..., None]
                v = np.where(ok, v, rows[-1])
            rows.append(v)
        value = _bicubic_1d(*rows, dy)
    return value, filled


def _truncate(value, filled):
    out = np.trunc(np.clip(value, 0, 255)).astype(np.uint8)
    out[filled] = FILL
    return out


def _check(arr, matrix, resample, pil_image, ours):
    value, filled = _pillow_values(arr, matrix, resample)
    pil = np.asarray(pil_image)
    np.testing.assert_array_equal(_truncate(value, filled), pil)  # the model is Pillow
    ours = ours.numpy()
    assert ours.dtype == np.uint8 and ours.shape == arr.shape
    np.testing.assert_array_equal(ours[filled], pil[filled])
    diff = np.abs(ours.astype(int) - pil)
    assert diff.max() <= 1
    clipped = np.clip(value, 0, 255)
    frac = clipped - np.floor(clipped)
    near = (frac < eps()) | (frac > 1 - eps())
    assert near[diff > 0].all(), "a pixel differs where Pillow's value is no rounding"


ARRAYS = [_photo(24, 32, 0), _photo(31, 17, 1), _photo(40, 40, 2)]
RESAMPLES = [geometry.BILINEAR, geometry.BICUBIC]


@pytest.mark.parametrize("resample", RESAMPLES)
def test_rotate_is_pillows_exactly(resample):
    rng = random.Random(resample)
    for arr in ARRAYS:
        im, t = Image.fromarray(arr), torch.from_numpy(arr)
        for degrees in [0.0, 30.0, -27.3, 45.0, 180.0] + [
            rng.uniform(-45, 45) for _ in range(4)
        ]:
            want = timm_aa.rotate(im, degrees, resample=resample, fillcolor=FILL)
            got = geometry.rotate(t, degrees, resample, FILL)
            np.testing.assert_array_equal(got.numpy(), np.asarray(want))


def test_rotate_shortcuts_are_exact():
    arr = ARRAYS[2]  # square: 90 and 270 are transpositions too
    im, t = Image.fromarray(arr), torch.from_numpy(arr)
    for degrees in (0, 90, 180, 270, 360):
        want = np.asarray(im.rotate(degrees, geometry.BICUBIC, fillcolor=FILL))
        np.testing.assert_array_equal(
            geometry.rotate(t, degrees, 3, FILL).numpy(), want
        )


@pytest.mark.parametrize("resample", RESAMPLES)
def test_shears_and_translations_are_pillows(resample):
    rng = random.Random(resample)
    for arr in ARRAYS:
        im, t = Image.fromarray(arr), torch.from_numpy(arr)
        h, w = arr.shape[:2]
        shears = [0.0, 0.3, -0.3, 0.45, 1.0, 2.5] + [
            rng.uniform(-0.45, 0.45) for _ in range(3)
        ]
        moves = [0.0, 3.0, -0.5, 0.5, 0.675 * w, 2.0 * w] + [
            rng.uniform(-w, w) for _ in range(3)
        ]
        kw = {"resample": resample, "fillcolor": FILL}
        for factor in shears:
            for matrix, pil, ours in (
                ((1, factor, 0, 0, 1, 0), timm_aa.shear_x, geometry.shear_x),
                ((1, 0, 0, factor, 1, 0), timm_aa.shear_y, geometry.shear_y),
            ):
                _check(
                    arr,
                    matrix,
                    resample,
                    pil(im, factor, **kw),
                    ours(t, factor, resample, FILL),
                )
        for pixels in moves:
            for matrix, pil, ours in (
                (
                    (1, 0, pixels, 0, 1, 0),
                    timm_aa.translate_x_abs,
                    geometry.translate_x,
                ),
                (
                    (1, 0, 0, 0, 1, pixels),
                    timm_aa.translate_y_abs,
                    geometry.translate_y,
                ),
            ):
                _check(
                    arr,
                    matrix,
                    resample,
                    pil(im, pixels, **kw),
                    ours(t, pixels, resample, FILL),
                )


def test_a_general_matrix_is_pillows_exactly():
    # A skewed scaling; and source points exactly on the edges 0 and width (17 wide:
    # 2 (x + 0.5) reaches 17 at x = 8), which Pillow keeps and fills respectively
    # (the float64 model of Pillow is checked on them too).
    cases = [
        (ARRAYS[0], (0.8, 0.25, 3.3, -0.15, 1.1, -2.0)),
        (ARRAYS[1], (2.0, 0.0, 0.0, 0.0, 2.0, 0.0)),
        (ARRAYS[1], (2.0, 0.0, -1.0, 0.0, 1.0, -0.5)),
    ]
    for arr, matrix in cases:
        for resample in RESAMPLES:
            size = (arr.shape[1], arr.shape[0])
            want = Image.fromarray(arr).transform(
                size, Image.AFFINE, matrix, resample, fillcolor=FILL
            )
            got = geometry.affine(torch.from_numpy(arr), matrix, resample, FILL)
            np.testing.assert_array_equal(got.numpy(), np.asarray(want))
            _check(arr, matrix, resample, want, got)


def test_other_resampling_is_refused():
    with pytest.raises(ValueError, match="resample"):
        geometry.shear_x(torch.from_numpy(ARRAYS[0]), 0.1, 0, FILL)  # NEAREST
