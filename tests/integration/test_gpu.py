"""Tests that need a CUDA device: marked `gpu`, skipped unless pytest --gpu (or
PYCLS_FAST_TEST_GPU=1) on a GPU node (see conftest.py)."""

import pytest
import torch

from pycls_fast.datasets.to_device.transform import DeviceBatchTransform, to_device
from tests.unit.datasets.to_device.test_transform import _cfg, _images

pytestmark = pytest.mark.gpu


def test_to_device_cuda_pinned_non_blocking():
    images, labels = _images(), torch.tensor([1, 2, 3, 0])
    x, y = to_device(images, labels, "cuda")
    assert x.is_cuda and torch.equal(x.cpu(), images) and torch.equal(y.cpu(), labels)


def test_lighting_is_drawn_on_the_cuda_device():
    prep = DeviceBatchTransform(_cfg(), "cuda")
    assert prep.generator.device.type == "cuda"
    x, _ = prep(_images(), torch.tensor([1, 2, 3, 0]))
    assert x.is_cuda
    prep.load_state_dict(prep.state_dict())


def test_prefetcher_on_a_side_stream_matches_the_plain_transform():
    from pycls_fast.datasets.to_device.prefetch import DevicePrefetcher
    from tests.unit.datasets.to_device.test_prefetch import _Loader

    cfg = _cfg()
    cfg.TRAIN.PCA_STD = 0.0  # no random draws: both paths give the same values
    plain = DeviceBatchTransform(cfg, "cuda")
    expected = [plain(x, y) if len(y) else (x, y) for x, y in _Loader()]
    got = list(DevicePrefetcher(_Loader(), DeviceBatchTransform(cfg, "cuda")))
    for (gx, gy), (ex, ey) in zip(got, expected):
        assert torch.equal(gx.cpu(), ex.cpu()) and torch.equal(gy.cpu(), ey.cpu())


def test_device_augmentation_on_cuda_equals_the_cpu_and_never_syncs():
    """TRAIN.AUGMENT_BACKEND device on CUDA: the same pixels as on the CPU (which
    equal Pillow's: tests/unit/datasets/to_device/test_augment_policy.py), with
    CUDA's sync debug mode raising at any wait for the device."""
    import random

    from pycls_fast.datasets.to_device.augment_policy import DeviceAugment
    from tests.unit.datasets.to_device.test_augment_policy import _batch, _photos

    images = _batch(_photos(32, 40, 48, seed=2))
    for augment, interpolation in (("rand-m9-mstd0.5-inc1", "bicubic"),
                                   ("AutoAugment", "random")):  # fmt: skip
        policy = DeviceAugment(augment, interpolation)
        want = policy(images, random.Random(7))
        on_gpu = images.cuda()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = policy(on_gpu, random.Random(7))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.equal(got.cpu(), want), augment
