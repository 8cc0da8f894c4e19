"""TRAIN.AUGMENT_BACKEND device: timm's ops on a uint8 batch, one parameter per image,
against timm's own PIL ops; the policy's draws against the host policy's; its place in
DeviceBatchTransform (resume, the host left to crop and flip); no host syncs.

Every comparison is exact: batch_ops repeats Pillow's arithmetic operation by operation
(float64 for the warps, float32 for the blends, integers elsewhere).
"""

import io
import random
from unittest import mock

import numpy as np
import pytest
import torch
from PIL import Image
from timm.data import auto_augment as timm_aa
from torch.utils._python_dispatch import TorchDispatchMode

from pycls_fast.config import get_cfg, load_cfg
from pycls_fast.datasets.images import geometry_ops, policies
from pycls_fast.datasets.images.decode import EncodedImage
from pycls_fast.datasets.images.transforms import (
    TrainTransform,
    make_augment,
    posterize_pil,
)
from pycls_fast.datasets.to_device import augment_policy
from pycls_fast.datasets.to_device.augment_policy import DeviceAugment
from pycls_fast.datasets.to_device.transform import DeviceBatchTransform
from pycls_fast.errors import ConfigError
from tests.unit.datasets.images.test_policies import PILLOW_WARPS

FILL = (124, 116, 104)


def _photos(n, h, w, seed=0):
    """uint8 (n, h, w, 3): gradients with noise, a flat image and a two-level one (the
    tables' edge cases: one used value, autocontrast's hi == lo)."""
    rng = np.random.default_rng(seed)
    base = np.linspace(0, 255, h * w * 3).reshape(h, w, 3)
    out = [
        np.clip(base + rng.integers(-90, 90, (h, w, 3)), 0, 255).astype(np.uint8)
        for _ in range(n)
    ]
    out[-1][...] = 77
    if n > 2:
        out[-2][...] = np.where(rng.random((h, w, 1)) < 0.5, 10, 200)
    if n > 3:  # values 0-55: autocontrast's table at 255 / 55 (no integer), where
        # 255 x (1 / 55) rounds otherwise and moves 5 of its values
        out[1] = (out[1].astype(np.int64) * 55 // 255).astype(np.uint8)
    return np.stack(out)


def _batch(arr, channels_last=False):
    """uint8 (N, 3, H, W); channels-last memory as the loader's batches."""
    x = torch.from_numpy(arr).permute(0, 3, 1, 2)
    return x if channels_last else x.contiguous()


def _timm_op(name):
    if name.startswith("Posterize"):
        return posterize_pil
    return timm_aa.NAME_TO_OP[name]


# name -> one argument per image (4 images), spanning each op's range and its edges.
ARGS = {
    "AutoContrast": [()] * 4,
    "Equalize": [()] * 4,
    "Invert": [()] * 4,
    "Rotate": [(-29.7,), (13.1,), (0.4,), (30.0,)],
    "Posterize": [(0,), (3,), (7,), (8,)],
    "PosterizeIncreasing": [(1,), (4,), (2,), (0,)],
    "PosterizeOriginal": [(4,), (8,), (5,), (6,)],
    "Solarize": [(0,), (127.5,), (255,), (256,)],
    "SolarizeIncreasing": [(12,), (200,), (1,), (90,)],
    "SolarizeAdd": [(0,), (110,), (37,), (128,)],
    "Color": [(0.1,), (1.9,), (0.0,), (1.37,)],
    "ColorIncreasing": [(0.19,), (1.81,), (1.0,), (0.6,)],
    "Desaturate": [(0.5,), (1.0,), (0.73,), (0.9,)],
    "Contrast": [(0.1,), (1.9,), (0.0,), (1.37,)],
    "ContrastIncreasing": [(0.19,), (1.81,), (1.0,), (0.6,)],
    "Brightness": [(0.1,), (1.9,), (0.0,), (1.37,)],
    "BrightnessIncreasing": [(0.19,), (1.81,), (1.0,), (0.6,)],
    "Sharpness": [(0.1,), (1.9,), (0.0,), (1.37,)],
    "SharpnessIncreasing": [(0.19,), (1.81,), (1.0,), (0.6,)],
    "ShearX": [(-0.3,), (0.27,), (0.01,), (0.3,)],
    "ShearY": [(0.3,), (-0.13,), (0.2,), (-0.3,)],
    "TranslateX": [(-10.0,), (4.5,), (0.3,), (100.0,)],
    "TranslateY": [(7.25,), (-3.0,), (-0.6,), (12.0,)],
    "TranslateXRel": [(-0.45,), (0.1,), (0.033,), (0.45,)],
    "TranslateYRel": [(0.45,), (-0.2,), (0.07,), (-0.45,)],
    "GaussianBlur": [(0.1,), (1.7,), (2.0,), (0.63,)],
}
# timm's ops that draw inside (their draws: the policy tests below).
DRAWING = {"GaussianBlurRand"}


def test_every_supported_op_has_a_case():
    assert set(ARGS) | DRAWING == augment_policy.SUPPORTED


@pytest.mark.parametrize("resample", [geometry_ops.BILINEAR, geometry_ops.BICUBIC])
@pytest.mark.parametrize("shape", [(29, 37), (24, 24)])
@pytest.mark.parametrize("name", sorted(ARGS))
def test_each_op_per_image_equals_timms_pil_op(name, shape, resample):
    arr = _photos(4, *shape, seed=len(name))
    images = _batch(arr)
    # Images 0, 1 and 3 draw the op (2 is left alone), each with its own argument.
    members = [(i, ARGS[name][i]) for i in (0, 1, 3)]
    out = images.clone()
    augment_policy.apply_op(out, name, members, resample, FILL)
    for i in range(4):
        want = arr[i]
        if i != 2:
            pil = _timm_op(name)(
                Image.fromarray(arr[i]), *ARGS[name][i], resample=resample,
                fillcolor=FILL,
            )  # fmt: skip
            want = np.asarray(pil)
        got = out[i].permute(1, 2, 0).numpy()
        np.testing.assert_array_equal(got, want, err_msg=f"{name} image {i}")


def test_rotation_shortcuts_are_pillows():
    arr = _photos(4, 24, 24)
    images = _batch(arr)
    degrees = [0.0, 180.0, 90.0, -90.0]
    out = images.clone()
    augment_policy.apply_op(
        out, "Rotate", [(i, (d,)) for i, d in enumerate(degrees)], 3, FILL
    )
    for i, d in enumerate(degrees):
        want = np.asarray(Image.fromarray(arr[i]).rotate(d, resample=3, fillcolor=FILL))
        np.testing.assert_array_equal(out[i].permute(1, 2, 0).numpy(), want)


# The recipes' and timm's other RandAugment / AutoAugment strings with batched forms.
POLICIES = [
    ("rand-m9-mstd0.5-inc1", "bicubic"),  # DeiT
    ("AutoAugment", "random"),  # pycls
    ("rand-m15-n2-mmax15-p1.0", "bilinear"),
    ("RandAugment_N2_M0.5", "random"),
    ("original", "bicubic"),
    ("v0r", "bilinear"),
    ("rand-m9-mstd1-tweights", "random"),
    ("rand-m9-n3-t3a", "bicubic"),  # GaussianBlurRand, Desaturate
    ("rand-m9-n2-t3aw", "random"),
]


@pytest.mark.parametrize("augment, interpolation", POLICIES)
def test_same_draws_same_pixels_as_the_host_policy(augment, interpolation):
    """For one generator, the batch equals the host policy applied image by image
    (its warps swapped for Pillow's own, which the device ones equal exactly)."""
    arr = _photos(12, 20, 24, seed=3)
    host = policies.from_timm(make_augment(augment, 24, interpolation))
    device = DeviceAugment(augment, interpolation)
    for seed in range(6):
        got = device(_batch(arr, channels_last=seed % 2 == 1), random.Random(seed))
        rng = random.Random(seed)
        with mock.patch.multiple(geometry_ops, **PILLOW_WARPS):
            want = [host(torch.from_numpy(a.copy()), rng).numpy() for a in arr]
        np.testing.assert_array_equal(
            got.permute(0, 2, 3, 1).numpy(), np.stack(want), err_msg=str(seed)
        )


def test_every_image_drawn_alone_across_the_batch():
    """Ops group by name per layer: images that drew different ops in the same layer
    each get their own, and an image's two layers apply in order."""
    arr = _photos(32, 16, 16, seed=5)
    device = DeviceAugment("rand-m9-mstd0.5-inc1", "bicubic")
    draws = device.draw(32, 16, random.Random(1))
    names = {layers[0][0] for layers in draws if layers[0] is not None}
    assert len(names) >= 8  # many groups in one layer
    got = device(_batch(arr), random.Random(1))
    host = device.policy(16)
    rng = random.Random(1)
    with mock.patch.multiple(geometry_ops, **PILLOW_WARPS):
        want = np.stack([host(torch.from_numpy(a.copy()), rng).numpy() for a in arr])
    np.testing.assert_array_equal(got.permute(0, 2, 3, 1).numpy(), want)


@pytest.mark.parametrize("augment", ["augmix-m5-w4-d2", "augmix-m3-w3-b1"])
def test_augmix_is_refused_in_one_line(augment):
    with pytest.raises(ConfigError) as err:
        DeviceAugment(augment, "bicubic")
    message = str(err.value)
    assert "AugMix" in message and "TRAIN.AUGMENT_BACKEND" in message
    assert "\n" not in message


@pytest.mark.parametrize(
    "three, jitter, augment",
    [(True, 0.3, ""), (False, 0.4, ""), (True, 0.0, ""),
     (True, 0.3, "rand-m9-mstd0.5-inc1")],
)  # fmt: skip
def test_deit3_pieces_same_draws_same_pixels_as_the_host(three, jitter, augment):
    """3-Augment (grayscale, solarize, Pillow's Gaussian blur), colour jitter and a
    policy after them: the host's draws in the host's order, the same pixels."""
    from pycls_fast.datasets.images import augment as deit

    arr = _photos(12, 20, 24, seed=11)
    device = DeviceAugment(augment, "bicubic", three, jitter)
    host = policies.from_timm(make_augment(augment, 24, "bicubic")) if augment else None
    for seed in range(4):
        got = device(_batch(arr), random.Random(seed))
        rng = random.Random(seed)
        want = []
        with mock.patch.multiple(geometry_ops, **PILLOW_WARPS):
            for a in arr:
                x = torch.from_numpy(a.copy())
                if three:
                    x = deit.three_augment_tensor(x, rng)
                if jitter:
                    x = deit.color_jitter_tensor(x, jitter, rng)
                if host is not None:
                    x = host(x, rng)
                want.append(x.numpy())
        np.testing.assert_array_equal(
            got.permute(0, 2, 3, 1).numpy(), np.stack(want), err_msg=str(seed)
        )
    blurred = [
        layers[0]
        for layers in device.draw(64, 24, random.Random(0))
        if layers and layers[0][0] == "GaussianBlur"
    ]
    assert not three or blurred  # the blur was drawn and compared


class _Reads(TorchDispatchMode):
    """Records the ops that read a tensor's value back to Python (a host sync on a
    GPU): .item(), .tolist(), bool(), nonzero's size."""

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if "_local_scalar_dense" in name or "nonzero" in name:
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


def test_the_batch_ops_read_nothing_back():
    arr = _photos(4, 20, 24)
    device = DeviceAugment("rand-m15-n2-mmax15-p1.0", "random")
    with _Reads() as mode:
        for name in sorted(ARGS):
            out = _batch(arr)
            augment_policy.apply_op(out, name, [(0, ARGS[name][0])], 3, FILL)
        device(_batch(arr), random.Random(0))
    assert mode.reads == []
    # The recorder does see a read (the test can fail).
    with _Reads() as mode:
        torch.ones(2).sum().item()
    assert mode.reads


def _cfg(backend="device", augment="rand-m9-mstd0.5-inc1"):
    cfg = get_cfg()
    cfg.TRAIN.AUGMENT = augment
    cfg.TRAIN.AUGMENT_BACKEND = backend
    cfg.TRAIN.AUGMENT_INTERPOLATION = "bicubic"
    cfg.TRAIN.RANDOM_ERASE = 0.25
    return cfg


def test_device_batch_transform_augments_and_resumes_exactly():
    arr = _photos(8, 16, 16, seed=9)
    prep = DeviceBatchTransform(_cfg(), "cpu")
    plain = DeviceBatchTransform(_cfg(augment=""), "cpu")
    labels = torch.arange(8)
    state = prep.state_dict()
    first = [prep(_batch(arr), labels)[0] for _ in range(3)]
    assert not torch.equal(first[0], plain(_batch(arr), labels)[0])
    assert not torch.equal(first[0], first[1])  # fresh draws per batch
    prep.load_state_dict(state)
    again = [prep(_batch(arr), labels)[0] for _ in range(3)]
    for a, b in zip(first, again):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    images = _batch(arr)
    prep(images, labels)
    np.testing.assert_array_equal(images.permute(0, 2, 3, 1).numpy(), arr)  # untouched
    # Evaluation never augments.
    test = DeviceBatchTransform(_cfg(), "cpu", train=False)
    assert test.augment is None


def test_the_host_only_crops_and_flips_with_the_device_backend():
    buf = io.BytesIO()
    Image.fromarray(_photos(2, 40, 52)[0]).save(buf, format="JPEG")
    outs = []
    for backend, augment in (("device", "rand-m9-mstd0.5-inc1"), ("tensor", "")):
        out = np.zeros((16, 16, 3), np.uint8)
        on = backend == "device"  # with every host augmentation asked for
        transform = TrainTransform(
            16,
            augment,
            three_augment=on,
            color_jitter=0.3 * on,
            augment_backend=backend,
        )
        transform(EncodedImage(buf.getvalue()), random.Random(4), out)
        outs.append(out)
    np.testing.assert_array_equal(*outs)
    assert outs[0].any()


def test_config_takes_the_device_backend_and_refuses_others():
    cfg = load_cfg(opts=["TRAIN.AUGMENT_BACKEND", "device"])
    assert cfg.TRAIN.AUGMENT_BACKEND == "device"
    with pytest.raises(ConfigError, match="TRAIN.AUGMENT_BACKEND"):
        load_cfg(opts=["TRAIN.AUGMENT_BACKEND", "gpu"])
