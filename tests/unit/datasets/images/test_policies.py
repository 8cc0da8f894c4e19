"""policies against timm's own transforms: for every augmentation string, timm's
AutoAugment / RandAugment / AugMix on PIL images and ours on tensors give the same
image for the same draws.

timm draws from the global `random` and `numpy.random`; here both are replaced, inside
timm's module only, by the image's generator, called the way our policies call it. With
the geometric ops swapped for Pillow's own (their float32 rounding is
test_geometry_ops' subject), the two images are then equal exactly: same ops chosen,
same magnitudes, signs and interpolations, same pixels.
"""

import pickle
import random
import types
from unittest import mock

import numpy as np
import pytest
import torch
from PIL import Image
from timm.data import auto_augment as timm_aa

from pycls_fast.datasets.images import geometry_ops, policies
from pycls_fast.datasets.images.transforms import make_augment
from tests.helpers import sampling_band


def _photo(h, w, seed):
    rng = np.random.default_rng(seed)
    base = np.linspace(0, 255, w * h * 3).reshape(h, w, 3)
    return np.clip(base + rng.integers(-60, 60, (h, w, 3)), 0, 255).astype(np.uint8)


class _NumpyDraws:
    """timm's module's `np`, its random draws made from `rng` as policies makes them."""

    def __init__(self, rng):
        self.rng = rng
        self.random = types.SimpleNamespace(
            choice=self.choice, dirichlet=self.dirichlet, beta=self.beta,
            randint=self.randint,
        )  # fmt: skip

    def __getattr__(self, name):
        return getattr(np, name)

    def choice(self, items, n, replace=True, p=None):
        if p is None:
            return [self.rng.choice(items) for _ in range(n)]
        return policies.RandAugment(list(items), n, list(p)).choose(self.rng)

    def dirichlet(self, alphas):
        gammas = np.array([self.rng.gammavariate(alphas[0], 1.0) for _ in alphas])
        return gammas / gammas.sum()

    def beta(self, a, b):
        return self.rng.betavariate(a, b)

    def randint(self, low, high):
        return self.rng.randint(low, high - 1)


def _pillow_warp(timm_fn):
    """A geometry_ops function computed by timm's PIL op."""

    def warp(img, value, resample, fill):
        im = Image.fromarray(img.numpy())
        out = timm_fn(im, value, resample=resample, fillcolor=fill)
        return torch.from_numpy(np.array(out))

    return warp


PILLOW_WARPS = {
    "rotate": _pillow_warp(timm_aa.rotate),
    "shear_x": _pillow_warp(timm_aa.shear_x),
    "shear_y": _pillow_warp(timm_aa.shear_y),
    "translate_x": _pillow_warp(timm_aa.translate_x_abs),
    "translate_y": _pillow_warp(timm_aa.translate_y_abs),
}

# (TRAIN.AUGMENT, TRAIN.AUGMENT_INTERPOLATION): the shipped recipes' strings (DeiT,
# pycls, AugReg) and timm's other policies and options.
STRINGS = [
    ("rand-m9-mstd0.5-inc1", "bicubic"),
    ("AutoAugment", "random"),
    ("rand-m15-n2-mmax15-p1.0", "bilinear"),
    ("RandAugment_N2_M0.5", "random"),
    ("original", "bicubic"),
    ("originalr", "random"),
    ("v0", "random"),
    ("v0r", "bilinear"),
    ("augmix-m5-w4-d2", "bilinear"),
    ("augmix-m3-w3-b1", "bicubic"),
    ("rand-m9-n3-t3a", "bicubic"),
    ("rand-m9-n2-t3aw", "random"),
    ("rand-m9-mstd1-tweights", "random"),
    ("rand-mstd101-m9", "random"),
]


@pytest.mark.parametrize("augment, interpolation", STRINGS)
def test_same_draws_same_image_as_timm(augment, interpolation):
    arr = _photo(20, 24, 0)
    im = Image.fromarray(arr)
    timm_transform = make_augment(augment, 24, interpolation)
    ours = policies.from_timm(timm_transform)
    with mock.patch.multiple(geometry_ops, **PILLOW_WARPS):
        for seed in range(40):
            rng = random.Random(seed)
            with (
                mock.patch.object(timm_aa, "random", rng),
                mock.patch.object(timm_aa, "np", _NumpyDraws(rng)),
            ):
                want = np.asarray(timm_transform(im))
            got = ours(torch.from_numpy(arr.copy()), random.Random(seed))
            np.testing.assert_array_equal(got.numpy(), want, err_msg=str(seed))


def test_policies_leave_the_global_generators_alone():
    arr = torch.from_numpy(_photo(20, 24, 1))
    random.seed(5)
    np.random.seed(5)
    state, np_state = random.getstate(), np.random.get_state()
    for augment, interpolation in STRINGS:
        policy = policies.from_timm(make_augment(augment, 24, interpolation))
        a = policy(arr.clone(), random.Random(3))
        b = policy(arr.clone(), random.Random(3))
        assert torch.equal(a, b)
    assert random.getstate() == state
    assert np.array_equal(np.random.get_state()[1], np_state[1])


def test_policies_pickle_and_apply_the_same_after():
    arr = torch.from_numpy(_photo(20, 24, 2))
    for augment, interpolation in STRINGS:
        policy = policies.from_timm(make_augment(augment, 24, interpolation))
        copy = pickle.loads(pickle.dumps(policy))
        for seed in range(5):
            want = policy(arr.clone(), random.Random(seed))
            assert torch.equal(copy(arr.clone(), random.Random(seed)), want)


def test_weighted_choice_draws_without_replacement_in_proportion():
    weights = [3.0, 1.0, 0.5, 0.5]
    policy = policies.RandAugment(list("abcd"), 2, weights)
    draws = 4000
    first = {k: 0 for k in "abcd"}
    for seed in range(draws):
        a, b = policy.choose(random.Random(seed))
        assert a != b
        first[a] += 1
    for k, w in zip("abcd", weights):
        p = w / sum(weights)
        assert abs(first[k] / draws - p) < sampling_band(draws, (p * (1 - p)) ** 0.5)


def test_from_timm_refuses_other_transforms():
    with pytest.raises(TypeError, match="not a timm augmentation policy"):
        policies.from_timm(object())
