"""Device-side batch prep: normalization, PCA lighting, labels, mixup / cutmix."""

import numpy as np
import pytest
import torch

from pycls_fast.config import get_cfg
from pycls_fast.datasets.to_device.transform import (
    EIG_VALS,
    EIG_VECS,
    MEAN,
    STD,
    DeviceBatchTransform,
    cutmix_box,
    mix_batch,
    normalize,
    one_hot,
    pca_lighting_offsets,
    to_device,
)


def _images(b=4, size=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    nhwc = torch.randint(0, 256, (b, size, size, 3), dtype=torch.uint8, generator=g)
    return nhwc.permute(0, 3, 1, 2)  # channels-last NCHW, as the loader yields


def _reference(images, offsets=None):
    """The float64 reference: pycls's HWC float pipeline, transposed."""
    x = images.double() / 255
    if offsets is not None:
        x = x + offsets.double().view(-1, 3, 1, 1)
    mean = torch.tensor(MEAN, dtype=torch.float64).view(1, 3, 1, 1)
    std = torch.tensor(STD, dtype=torch.float64).view(1, 3, 1, 1)
    return (x - mean) / std


def _fp32_atol(offsets=None):
    """fp32 normalization vs the float64 reference, elementwise: the constants (1/255,
    mean, std) and up to 5 operations round once each, <= u = eps / 2 of a value at
    most (1 + |offset| + mean) / std in magnitude."""
    peak = 1 + max(MEAN) + (0 if offsets is None else offsets.abs().max().item())
    return 8 * torch.finfo(torch.float32).eps / 2 * peak / min(STD)


def test_normalize_equals_float_reference():
    images = _images()
    out = normalize(images)
    assert out.dtype == torch.float32 and out.shape == images.shape
    assert out.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(
        out.double(), _reference(images), atol=_fp32_atol(), rtol=0
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_normalize_in_half_precision_rounds_once(dtype):
    images = _images()
    out = normalize(images, dtype=dtype)
    assert out.dtype == dtype
    # Identical to rounding the exact result once: no error beyond the dtype's.
    assert torch.equal(out, _reference(images).float().to(dtype))


def test_pca_lighting_matches_pycls_formula():
    g = torch.Generator().manual_seed(3)
    offsets = pca_lighting_offsets(5, 0.1, generator=g)
    alpha = torch.randn(5, 3, generator=torch.Generator().manual_seed(3)) * 0.1
    vecs, vals = np.array(EIG_VECS), np.array(EIG_VALS)
    # pycls: rgb = sum(eig_vec * alpha * eig_val, axis=1), per image.
    expected = np.stack([(vecs * (a * vals)).sum(axis=1) for a in alpha.numpy()])
    # fp32: each term rounds its two table entries and two products (<= 4 u of the
    # term), the sum of 3 rounds twice (<= 2 u of the terms' magnitudes): 6 u.
    terms = np.stack([np.abs(vecs * (a * vals)).sum(axis=1) for a in alpha.numpy()])
    u = np.finfo(np.float32).eps / 2
    np.testing.assert_allclose(
        offsets.numpy(), expected, rtol=0, atol=6 * u * terms.max()
    )
    images = _images(b=5)
    out = normalize(images, offsets=offsets)
    torch.testing.assert_close(
        out.double(), _reference(images, offsets), atol=_fp32_atol(offsets), rtol=0
    )


def test_one_hot_with_smoothing():
    t = one_hot(torch.tensor([2, 0]), 4, smoothing=0.2)
    expected = torch.tensor([[0.05, 0.05, 0.85, 0.05], [0.85, 0.05, 0.05, 0.05]])
    torch.testing.assert_close(t, expected)
    torch.testing.assert_close(t.sum(1), torch.ones(2))


def _constant_batch(b=4, size=16):
    # Image i is filled with the value i, so pixel counts reveal the mixing.
    return (
        torch.arange(b, dtype=torch.float32).view(b, 1, 1, 1).expand(b, 3, size, size)
    )


def test_mixup_label_math():
    images, labels = _constant_batch(), torch.tensor([0, 1, 2, 3])
    targets = one_hot(labels, 4)
    rng = np.random.default_rng(0)
    lam_expected = np.random.default_rng(0).beta(0.8, 0.8)
    mixed, soft, lam = mix_batch(images, targets, 0.8, 0.0, rng)
    assert lam == pytest.approx(lam_expected)
    # Image i mixes with image 3 - i, with the same weights as its target.
    for i in range(4):
        assert mixed[i, 0, 0, 0].item() == pytest.approx(lam * i + (1 - lam) * (3 - i))
        assert soft[i, i].item() == pytest.approx(lam + (i == 3 - i) * (1 - lam))
        assert soft[i, 3 - i].item() == pytest.approx((1 - lam) + (i == 3 - i) * lam)
    torch.testing.assert_close(soft.sum(1), torch.ones(4))


def test_cutmix_label_weight_equals_pasted_area():
    images, labels = _constant_batch(size=32), torch.tensor([0, 1, 2, 3])
    targets = one_hot(labels, 4, smoothing=0.1)
    for seed in range(10):
        mixed, soft, lam = mix_batch(
            images, targets, 0.0, 1.0, np.random.default_rng(seed)
        )
        for i in range(4):
            own = (mixed[i, 0] == i).float().mean().item()
            assert own == pytest.approx(lam)
        expected = targets * lam + targets.flip(0) * (1 - lam)
        torch.testing.assert_close(soft, expected)
        torch.testing.assert_close(soft.sum(1), torch.ones(4))


def test_cutmix_box_area():
    top, bottom, left, right = cutmix_box(100, 100, 0.75, np.random.default_rng(0))
    assert 0 <= top < bottom <= 100 and 0 <= left < right <= 100
    assert (bottom - top) * (right - left) <= 50 * 50


def test_both_alphas_pick_each_mode():
    images, targets = _constant_batch(), one_hot(torch.arange(4), 4)
    rng, modes = np.random.default_rng(1), set()
    for _ in range(20):
        mixed, _, _ = mix_batch(images, targets, 1.0, 1.0, rng)
        values = mixed[0, 0].unique()
        modes.add("cutmix" if set(values.tolist()) <= {0.0, 3.0} else "mixup")
    assert modes == {"cutmix", "mixup"}


def test_to_device_cpu_keeps_uint8():
    images, labels = _images(), torch.tensor([1, 2, 3, 0])
    x, y = to_device(images, labels, "cpu")
    assert x.dtype == torch.uint8 and torch.equal(x, images) and torch.equal(y, labels)


def _cfg(**train):
    cfg = get_cfg()
    cfg.MODEL.NUM_CLASSES = 4
    for key, value in train.items():
        cfg.TRAIN[key] = value
    return cfg


def test_device_batch_transform_train_and_test():
    images, labels = _images(), torch.tensor([1, 2, 3, 0])
    plain = DeviceBatchTransform(_cfg(PCA_STD=0.0), "cpu")
    x, y = plain(images, labels)
    torch.testing.assert_close(
        x.double(), _reference(images), atol=_fp32_atol(), rtol=0
    )
    assert torch.equal(y, labels)
    soft = DeviceBatchTransform(_cfg(MIXUP_ALPHA=0.2, LABEL_SMOOTHING=0.1), "cpu")
    x, y = soft(images, labels)
    assert x.dtype == torch.float32 and y.shape == (4, 4)
    torch.testing.assert_close(y.sum(1), torch.ones(4))
    bf16 = DeviceBatchTransform(_cfg(), "cpu", torch.bfloat16, train=False)
    x, y = bf16(images, labels)
    assert x.dtype == torch.bfloat16 and torch.equal(y, labels)
    assert torch.equal(x, _reference(images).float().bfloat16())
    # Lighting is on by default (pycls PCA_STD 0.1) and seeded by RNG_SEED.
    lit = [DeviceBatchTransform(_cfg(), "cpu")(images, labels)[0] for _ in range(2)]
    assert torch.equal(lit[0], lit[1]) and not torch.allclose(
        lit[0], plain(images, labels)[0]
    )


def test_lighting_draws_are_those_of_the_host_generator_on_cpu():
    # The pre-device-generator path, written out: same seed, same bits on a CPU.
    cfg = _cfg(MIXUP_ALPHA=0.0)
    images, labels = _images(), torch.tensor([1, 2, 3, 0])
    rng = np.random.default_rng([cfg.RNG_SEED, 1])
    g = torch.Generator().manual_seed(int(rng.integers(2**62)))
    prep = DeviceBatchTransform(cfg, "cpu", rank=1)
    for _ in range(3):
        alpha = torch.randn(4, 3, generator=g) * cfg.TRAIN.PCA_STD
        vecs = torch.tensor(EIG_VECS, dtype=torch.float32)
        vals = torch.tensor(EIG_VALS, dtype=torch.float32)
        expected = normalize(images, offsets=(alpha * vals) @ vecs.T)
        assert torch.equal(prep(images, labels)[0], expected)


def test_random_state_round_trips_through_a_weights_only_file(tmp_path):
    cfg = _cfg(MIXUP_ALPHA=0.2, CUTMIX_ALPHA=1.0)
    images, labels = _images(), torch.tensor([1, 2, 3, 0])
    prep = DeviceBatchTransform(cfg, "cpu")
    prep(images, labels)
    torch.save(prep.state_dict(), tmp_path / "rng.pt")
    expected = [prep(images, labels) for _ in range(3)]
    state = torch.load(tmp_path / "rng.pt", weights_only=True)
    assert state["torch"].dtype == torch.uint8
    resumed = DeviceBatchTransform(cfg, "cpu", rank=5)  # another stream until loaded
    resumed.load_state_dict(state)
    for x, y in expected:
        rx, ry = resumed(images, labels)
        assert torch.equal(rx, x) and torch.equal(ry, y)


def test_bgr_order_is_pycls_loader_input():
    """pycls feeds BGR pixels normalized with BGR means and stds (its _MEAN / _SD
    lists are the RGB ones reversed), lighting included."""
    images = _images()
    cfg = _cfg(PCA_STD=0.1)
    cfg.DATA.CHANNEL_ORDER = "bgr"
    bgr = DeviceBatchTransform(cfg, "cpu", torch.float32, train=True)
    rgb = DeviceBatchTransform(_cfg(PCA_STD=0.1), "cpu", torch.float32, train=True)
    ours, _ = bgr(images, torch.arange(4))
    plain, _ = rgb(images, torch.arange(4))
    torch.testing.assert_close(ours, plain[:, [2, 1, 0]])  # same lighting draws
    bgr_mean = torch.tensor(MEAN[::-1]).view(1, 3, 1, 1)
    bgr_std = torch.tensor(STD[::-1]).view(1, 3, 1, 1)
    test = DeviceBatchTransform(cfg, "cpu", torch.float32, train=False)
    expected = (images[:, [2, 1, 0]].float() / 255 - bgr_mean) / bgr_std
    torch.testing.assert_close(test(images, torch.arange(4))[0], expected)
    assert test(images, torch.arange(4))[0].is_contiguous(
        memory_format=torch.channels_last
    )


@pytest.mark.parametrize("tagged", [True, False], ids=["tagged", "untagged"])
def test_a_generator_state_of_another_device_leaves_it_as_seeded(tagged, caplog):
    # A CUDA generator's state is 16 bytes (seed, offset), a CPU generator's 5056:
    # resuming on CUDA from a CPU-written checkpoint is the same mismatch, the other
    # way round. Checkpoints from before the device tag carry no "device" key.
    cfg = _cfg(MIXUP_ALPHA=0.2)
    images, labels = _images(), torch.tensor([1, 2, 3, 0])
    saved = DeviceBatchTransform(cfg, "cpu")
    saved(images, labels)
    state = saved.state_dict()
    state["torch"] = torch.zeros(16, dtype=torch.uint8)  # what CUDA's get_state gives
    if tagged:
        state["device"] = "cuda"
    else:
        state.pop("device", None)
    expected_mix = saved.rng.bit_generator.state
    resumed = DeviceBatchTransform(cfg, "cpu", rank=3)
    seeded = resumed.generator.get_state()
    with caplog.at_level("INFO"):
        resumed.load_state_dict(state)
    assert resumed.rng.bit_generator.state == expected_mix  # the host draws resume
    assert torch.equal(resumed.generator.get_state(), seeded)  # the device's: seeded
    assert "not restored" in caplog.text
