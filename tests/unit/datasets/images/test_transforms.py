"""Host transforms: crop boxes, test-time resize + center crop, augment strings."""

import io
import math
import random

import numpy as np
import pytest
from PIL import Image

from pycls_fast.config import ConfigError
from pycls_fast.datasets.images.decode import EncodedImage
from pycls_fast.datasets.images.transforms import (
    TestTransform as EvalTransform,
)
from pycls_fast.datasets.images.transforms import (
    TrainTransform,
    center_crop_box,
    make_augment,
    random_resized_crop_box,
)


def _gradient(w, h):
    """A smooth RGB test image (resampling differences stay small on it)."""
    x = np.linspace(0, 255, w)[None, :, None]
    y = np.linspace(0, 255, h)[:, None, None]
    arr = np.concatenate([x + 0 * y, y + 0 * x, (x + y) / 2], axis=2)
    return Image.fromarray(arr.astype(np.uint8))


def _encoded(im, fmt="PNG"):
    """`im` saved as `fmt` (PNG: lossless), as the loader reads it."""
    buf = io.BytesIO()
    im.save(buf, format=fmt, quality=95)
    return EncodedImage(buf.getvalue())


def _apply(transform, image, rng, size=32):
    out = np.empty((size, size, 3), dtype=np.uint8)
    transform(image, rng, out)
    return out


def test_random_resized_crop_box_ranges():
    rng = random.Random(0)
    for _ in range(500):
        left, top, right, bottom = random_resized_crop_box(500, 375, rng)
        w, h = right - left, bottom - top
        assert 0 <= left < right <= 500 and 0 <= top < bottom <= 375
        assert 0.08 * 0.98 <= w * h / (500 * 375) <= 1.0
        assert 3 / 4 * 0.95 <= w / h <= 4 / 3 * 1.05


def test_random_resized_crop_box_deterministic_and_fallback():
    boxes = [random_resized_crop_box(500, 375, random.Random(7)) for _ in range(2)]
    assert boxes[0] == boxes[1]
    # A 1000x10 strip never fits a 3/4..4/3 crop of >= 8% area: center crop at 4/3.
    assert random_resized_crop_box(1000, 10, random.Random(0)) == (493, 0, 506, 10)


def test_center_crop_box_is_pycls_scale_then_crop():
    # Shorter side 300 -> 256, then a 224 center crop: 262.5 source pixels.
    left, top, right, bottom = center_crop_box(400, 300, 256, 224)
    assert math.isclose(right - left, 262.5) and math.isclose(bottom - top, 262.5)
    assert math.isclose(left, 68.75) and math.isclose(top, 18.75)


def test_test_transform_matches_resize_then_crop():
    im = _gradient(96, 64)
    out = _apply(EvalTransform(32, 40), _encoded(im), None).astype(np.float64)
    # Reference: resize the shorter side to 40 (60x40), crop the central 32x32.
    ref = np.asarray(im.resize((60, 40), Image.BILINEAR)).astype(np.float64)
    ref = ref[4:36, 14:46]
    assert out.shape == (32, 32, 3)
    assert np.abs(out - ref).mean() < 2.0


def test_train_transform_shape_determinism_and_flips():
    im = _encoded(_gradient(80, 60))
    t = TrainTransform(32)
    a = _apply(t, im, random.Random(3))
    b = _apply(t, im, random.Random(3))
    assert a.shape == (32, 32, 3) and a.dtype == np.uint8
    assert np.array_equal(a, b)
    # In the gradient, red grows left to right unless the crop was flipped.
    flipped = 0
    for seed in range(40):
        out = _apply(t, im, random.Random(seed)).astype(int)
        flipped += out[:, 0, 0].mean() > out[:, -1, 0].mean()
    assert 10 <= flipped <= 30


def test_make_augment_strings():
    assert make_augment("", 224) is None
    rand = make_augment("RandAugment_N3_M0.5", 224)
    assert rand.num_layers == 3
    assert {op.magnitude for op in rand.ops} == {5}
    assert {op.prob for op in rand.ops} == {1.0}  # pycls default P=1
    assert {op.prob for op in make_augment("RandAugment_M0.2_P0.5", 224).ops} == {0.5}
    auto = make_augment("AutoAugment", 224)
    out = auto(_gradient(32, 32))
    assert out.size == (32, 32)


@pytest.mark.parametrize("bad", ["RandAug", "RandAugment_X2", "RandAugment_N2"])
def test_make_augment_rejects_bad_strings(bad):
    with pytest.raises(ConfigError, match="TRAIN.AUGMENT"):
        make_augment(bad, 224)
