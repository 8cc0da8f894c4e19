"""DeiT / DeiT III augmentations against their references: timm's RandomErasing,
torchvision's ColorJitter, Grayscale, Resize + RandomCrop, and DeiT III's 3-Augment."""

import random
from unittest import mock

import numpy as np
import pytest
import torch
import torchvision.transforms as T
import torchvision.transforms.functional as F
from PIL import Image, ImageFilter, ImageOps
from timm.data.random_erasing import RandomErasing

from pycls_fast.config import get_cfg
from pycls_fast.datasets.images import augment
from pycls_fast.datasets.images.decode import EncodedImage
from pycls_fast.datasets.images.transforms import TrainTransform
from pycls_fast.datasets.to_device.transform import (
    DeviceBatchTransform,
    erase_batch,
    erase_boxes,
)
from tests.helpers import sampling_band


def _photo(w=60, h=44, seed=0):
    rng = np.random.default_rng(seed)
    base = np.linspace(0, 255, w * h * 3).reshape(h, w, 3)
    noise = rng.integers(0, 60, (h, w, 3))
    return Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8))


@pytest.mark.parametrize("count", [1, 3])
def test_erase_boxes_are_timms_for_the_same_seed(count):
    h, w = 24, 32
    timm_erase = RandomErasing(0.5, mode="const", max_count=count, device="cpu")
    erased = 0
    for seed in range(200):
        random.seed(seed)
        want = timm_erase(torch.ones(3, h, w))
        boxes = erase_boxes(random.Random(seed), h, w, 0.5, count)
        t = torch.zeros(1, count, 4, dtype=torch.int64)
        for k, box in enumerate(boxes):
            t[0, k] = torch.tensor(box)
        got = erase_batch(torch.ones(1, 3, h, w), t, "const")[0]
        assert torch.equal(got, want), seed
        erased += bool(boxes)
    assert 70 < erased < 130  # probability 0.5


def test_erase_fills_only_the_boxes():
    x = torch.full((2, 3, 16, 16), 7.0)
    boxes = torch.tensor([[[2, 3, 4, 5]], [[0, 0, 0, 0]]])
    gen = torch.Generator().manual_seed(0)
    out = erase_batch(x, boxes, "pixel", gen)
    changed = out != 7.0
    assert changed[0, :, 2:6, 3:8].all() and changed.sum() == 3 * 4 * 5
    out = erase_batch(x, boxes, "rand", gen)
    patch = out[0, :, 2:6, 3:8]
    assert (patch == patch[:, :1, :1]).all()  # one colour per box and channel
    assert (out[1] == 7.0).all()
    # A channels-last batch stays channels-last, with the same values.
    last = x.contiguous(memory_format=torch.channels_last)
    for mode in ("pixel", "rand", "const"):
        want = erase_batch(x, boxes, mode, torch.Generator().manual_seed(1))
        got = erase_batch(last, boxes, mode, torch.Generator().manual_seed(1))
        assert got.is_contiguous(memory_format=torch.channels_last), mode
        assert torch.equal(got, want), mode


def test_random_erasing_in_the_device_transform_resumes_exactly():
    cfg = get_cfg()
    cfg.TRAIN.RANDOM_ERASE, cfg.TRAIN.RANDOM_ERASE_COUNT = 0.5, 2
    cfg.TRAIN.PCA_STD = 0.0
    prep = DeviceBatchTransform(cfg, "cpu")
    images = torch.randint(0, 255, (8, 3, 32, 32), dtype=torch.uint8)
    labels = torch.arange(8)
    prep(images, labels)
    state = prep.state_dict()
    a, _ = prep(images, labels)
    again = DeviceBatchTransform(cfg, "cpu")
    again.load_state_dict(state)
    b, _ = again(images, labels)
    assert torch.equal(a, b)
    plain = DeviceBatchTransform(cfg.clone(), "cpu")
    plain.erase = 0.0
    c, _ = plain(images, labels)
    assert not torch.equal(a, c)


def test_simple_random_crop_is_torchvisions_resize_and_reflect_padded_crop():
    for size, (w, h) in ((32, (60, 44)), (24, (30, 50))):
        im = _photo(w, h)
        rng = random.Random(3)
        got = np.asarray(augment.simple_random_crop(im, size, rng))
        rng = random.Random(3)
        resized = F.resize(im, size, T.InterpolationMode.BICUBIC)
        padded = F.pad(resized, 4, padding_mode="reflect")
        top = rng.randint(0, padded.size[1] - size)
        left = rng.randint(0, padded.size[0] - size)
        want = np.asarray(F.crop(padded, top, left, size, size))
        assert got.shape == (size, size, 3)
        assert np.array_equal(got, want)


def test_three_augment_branches_and_frequencies():
    im = _photo()
    seen = {"gray": 0, "solarize": 0, "blur": 0}
    for seed in range(1500):
        out = augment.three_augment(im, random.Random(seed))
        rng = random.Random(seed)
        choice = rng.randrange(3)
        if choice == 0:
            want = T.Grayscale(num_output_channels=3)(im)
            seen["gray"] += 1
        elif choice == 1:
            want = ImageOps.solarize(im)  # DeiT III's Solarization: threshold 128
            seen["solarize"] += 1
        else:
            radius = rng.uniform(0.1, 2.0)
            want = im.filter(ImageFilter.GaussianBlur(radius=radius))
            seen["blur"] += 1
        assert np.array_equal(np.asarray(out), np.asarray(want)), seed
    band = sampling_band(1500, (1 / 3 * 2 / 3) ** 0.5)
    assert all(abs(n / 1500 - 1 / 3) < band for n in seen.values()), seen


def test_color_jitter_is_torchvisions_for_the_same_draws():
    im = _photo()
    for seed in range(20):
        got = augment.color_jitter(im, 0.3, random.Random(seed))
        order, (b, c, s) = augment.jitter_params(0.3, random.Random(seed))
        params = (torch.tensor([*order, 3]), b, c, s, None)
        jitter = T.ColorJitter(0.3, 0.3, 0.3)
        with mock.patch.object(T.ColorJitter, "get_params", return_value=params):
            want = jitter(im)
        assert np.array_equal(np.asarray(got), np.asarray(want)), seed
    factors = np.array(
        [augment.jitter_params(0.3, random.Random(s))[1] for s in range(4000)]
    )
    assert factors.min() >= 0.7 and factors.max() <= 1.3
    # Uniform on [0.7, 1.3]: mean 1, standard deviation 0.6 / sqrt(12).
    assert abs(factors.mean() - 1.0) < sampling_band(len(factors), 0.6 / 12**0.5)
    orders = {
        tuple(augment.jitter_params(0.3, random.Random(s))[0]) for s in range(200)
    }
    assert len(orders) == 6  # every order of the three operations occurs


def test_train_transform_with_deit_pieces_depends_only_on_the_seed():
    import io

    buf = io.BytesIO()
    _photo(80, 60).save(buf, format="JPEG")
    image = EncodedImage(buf.getvalue())
    transform = TrainTransform(
        32, crop="simple_random", three_augment=True, color_jitter=0.3
    )
    outs = []
    for seed in (5, 5, 6):
        out = np.zeros((32, 32, 3), np.uint8)
        transform(image, random.Random(seed), out)
        outs.append(out)
    assert np.array_equal(outs[0], outs[1]) and not np.array_equal(outs[0], outs[2])


def test_three_augment_and_color_jitter_on_tensors_are_the_pil_forms():
    """The tensor forms (TRAIN.AUGMENT_BACKEND tensor) make the same draws and give
    the same pixels as the PIL forms above, each branch and each order."""
    im = _photo(40, 30, seed=4)
    arr = np.array(im)  # writable: torch.from_numpy shares it
    branches = set()
    for seed in range(30):
        want = augment.three_augment(im, random.Random(seed))
        got = augment.three_augment_tensor(torch.from_numpy(arr), random.Random(seed))
        np.testing.assert_array_equal(got.numpy(), np.asarray(want), err_msg=str(seed))
        branches.add(random.Random(seed).randrange(3))
        want = augment.color_jitter(im, 0.4, random.Random(seed))
        got = augment.color_jitter_tensor(
            torch.from_numpy(arr), 0.4, random.Random(seed)
        )
        np.testing.assert_array_equal(got.numpy(), np.asarray(want), err_msg=str(seed))
    assert branches == {0, 1, 2}
