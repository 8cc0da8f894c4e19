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


def _timm_augment(augment: str, interpolation: str):
    """The augmentation timm's own train transform builds for `augment` (the
    reference: timm's transforms_imagenet_train, as DeiT calls it)."""
    from timm.data.auto_augment import AugMixAugment, AutoAugment, RandAugment
    from timm.data.transforms_factory import transforms_imagenet_train

    kinds = (RandAugment, AugMixAugment, AutoAugment)
    pipeline = transforms_imagenet_train(
        224, auto_augment=augment, interpolation=interpolation, separate=True
    )
    found = [t for stage in pipeline for t in stage.transforms if isinstance(t, kinds)]
    assert len(found) == 1
    return found[0]


def _ops(aug):
    ops = aug.ops if hasattr(aug, "ops") else [op for sub in aug.policy for op in sub]
    return [
        (op.name, op.prob, op.magnitude, op.magnitude_std, op.kwargs.get("resample"))
        for op in ops
    ]


@pytest.mark.parametrize(
    "augment, interpolation",
    [
        ("rand-m9-mstd0.5-inc1", "bicubic"),  # DeiT
        ("rand-m7-mstd0.5-inc1", "random"),
        ("augmix-m5-w4-d2", "bilinear"),
        ("original", "bicubic"),
        ("v0r", "random"),
    ],
)
def test_timm_strings_build_what_timm_builds(augment, interpolation):
    """A timm string gives the ops, magnitudes, noise, probabilities and
    interpolation that timm's own train transform gives for it."""
    ours = make_augment(augment, 224, interpolation)
    theirs = _timm_augment(augment, interpolation)
    assert type(ours) is type(theirs)
    assert _ops(ours) == _ops(theirs)
    for attr in ("num_layers", "width", "depth", "alpha", "choice_weights"):
        want = getattr(theirs, attr, None)
        got = getattr(ours, attr, None)
        assert (got is None) == (want is None)
        if want is not None:
            assert list(np.ravel(got)) == list(np.ravel(want)), attr
    out = ours(_gradient(32, 32))
    assert out.size == (32, 32)


def test_deit_string_has_magnitude_noise_and_increasing_ops():
    aug = make_augment("rand-m9-mstd0.5-inc1", 224, "bicubic")
    assert aug.num_layers == 2
    assert {op.magnitude for op in aug.ops} == {9}
    assert {op.magnitude_std for op in aug.ops} == {0.5}
    assert "SolarizeIncreasing" in {op.name for op in aug.ops}


@pytest.mark.parametrize("bad", ["rand-m9-bogus1", "augmix-q3", "nonsense"])
def test_bad_timm_strings_are_one_config_error(bad):
    with pytest.raises(ConfigError, match="TRAIN.AUGMENT"):
        make_augment(bad, 224)
