"""Host transforms: crop boxes, test-time resize + center crop, augment strings."""

import io
import math
import random
from unittest import mock

import numpy as np
import pytest
import torch
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


# The tensor backend (TRAIN.AUGMENT_BACKEND tensor): the augmentations run as torch ops
# on the crop in the batch row, every draw from the image's generator.

RECIPE_KEYS = ("TRAIN.AUGMENT", "TRAIN.THREE_AUGMENT", "TRAIN.COLOR_JITTER")


def _shipped_recipes():
    """Every config under configs/ that sets a recipe key, by its distinct train
    transform settings: {settings: [config files]}."""
    import glob
    import os

    import yaml

    from pycls_fast.config import load_cfg
    from tests.helpers import ROOT

    recipes = {}
    for path in sorted(
        glob.glob(os.path.join(ROOT, "configs", "**", "*.yaml"), recursive=True)
    ):
        with open(path) as f:
            text = f.read()
        if not any(k.split(".")[1] + ":" in text for k in RECIPE_KEYS):
            continue
        assert yaml.safe_load(text) is not None
        cfg = load_cfg(path, [])
        settings = (
            cfg.TRAIN.AUGMENT, cfg.TRAIN.AUGMENT_INTERPOLATION, cfg.TRAIN.THREE_AUGMENT,
            cfg.TRAIN.COLOR_JITTER, cfg.DATA.TRAIN_CROP, tuple(cfg.DATA.CROP_SCALE),
            cfg.DATA.HFLIP,
        )  # fmt: skip
        recipes.setdefault(settings, []).append(os.path.relpath(path, ROOT))
    return recipes


RECIPES = _shipped_recipes()


def test_the_shipped_recipes_are_found():
    augments = {settings[0] for settings in RECIPES}
    assert {
        "AutoAugment",
        "rand-m9-mstd0.5-inc1",
        "rand-m15-n2-mmax15-p1.0",
    } <= augments
    assert any(settings[2] and settings[3] for settings in RECIPES)  # DeiT III


@pytest.fixture(scope="module")
def small_index(tmp_path_factory):
    from pycls_fast.datasets.formats.index import scan_split
    from pycls_fast.datasets.formats.synthetic import make_image_folder

    root = str(tmp_path_factory.mktemp("recipes"))
    make_image_folder(
        root, ("train",), num_classes=2, images_per_class=3, size=(48, 40)
    )
    return scan_split(root + "/train")


def _posterize_reaches_zero_bits(policy) -> bool:
    """Whether a posterize op of `policy` can be asked for 0 or fewer bits: its
    magnitude (noise pushes it to the top of its range) maps there."""
    from pycls_fast.datasets.images import policies

    ops = getattr(policy, "ops", None) or [op for sub in policy.policy for op in sub]
    for op in ops:
        if op.name.startswith("Posterize"):
            top = op.magnitude_max or 10
            level = top if op.magnitude_std > 0 else min(op.magnitude, top)
            if policies.OPS[op.name][0](level, op.hparams, None)[0] <= 0:
                return True
    return False


@pytest.mark.parametrize(
    "settings", sorted(RECIPES, key=str), ids=lambda s: s[0] or "deit3"
)
def test_no_bad_images_on_clean_data_under_every_shipped_recipe(settings, small_index):
    """Each image of a small clean folder decoded many times (a seed per virtual
    index) by a decoding thread under the recipe's train transform: none is counted
    bad. Where the recipe's posterize can be asked for 0 bits (DeiT's RandAugment at
    m9 with magnitude noise: Pillow 13 raised ValueError and the image was dropped),
    images are decoded until such a draw has been made, so the test fails if it
    fails."""
    from concurrent.futures import ThreadPoolExecutor

    from pycls_fast.datasets.images import policies
    from pycls_fast.datasets.modes.batch import ImageDecoder

    augment, interpolation, three, jitter, crop, scale, hflip = settings
    transform = TrainTransform(
        32, augment, scale, hflip, crop, three, jitter, interpolation, "tensor"
    )
    decoder = ImageDecoder(small_index, transform, 32, seed=0)
    risky = transform.augment is not None and _posterize_reaches_zero_bits(
        transform.augment
    )
    zero_bits = []

    def counted(name):
        level_fn, op = policies.OPS[name]

        def op_counted(img, bits, *rest):
            zero_bits.append(bits <= 0)
            return op(img, bits, *rest)

        return level_fn, op_counted

    def decode_all():
        out = np.empty((32, 32, 3), np.uint8)
        bad, i = [], 0
        while i < 150 or (risky and not any(zero_bits) and i < 10_000):
            bad.append(decoder.load_into(i, 0, out))
            i += 1
        return bad

    names = [n for n in policies.OPS if n.startswith("Posterize")]
    patched = mock.patch.dict(policies.OPS, {n: counted(n) for n in names})
    with patched, ThreadPoolExecutor(1) as pool:  # a decoding thread, as the loader's
        bad = pool.submit(decode_all).result()
    assert [b for b in bad if b is not None] == []
    assert any(zero_bits) == risky
    if augment == "rand-m9-mstd0.5-inc1":
        assert risky


def test_pil_backend_posterize_zero_bits_is_every_bit_cleared():
    rand = make_augment("rand-m10-n1-p1.0-inc1", 32, "bilinear")  # level 10: 0 bits
    posterize = next(op for op in rand.ops if op.name == "PosterizeIncreasing")
    posterize.magnitude_std = 0
    out = posterize(_gradient(32, 32))
    assert not np.asarray(out).any()


def _decoder(index, **kw):
    from pycls_fast.datasets.modes.batch import ImageDecoder

    return ImageDecoder(index, TrainTransform(32, **kw), 32, seed=1)


DEIT = {"augment": "rand-m9-mstd0.5-inc1", "augment_interpolation": "bicubic"}
DEIT3 = {"three_augment": True, "color_jitter": 0.3}


@pytest.mark.parametrize("kw", [DEIT, DEIT3, {"augment": "augmix-m5-w4-d2"}])
def test_tensor_backend_depends_only_on_the_seed_and_pickles(kw, small_index):
    import pickle

    decoder = _decoder(small_index, **kw)
    copy = pickle.loads(pickle.dumps(decoder))
    random.seed(123)  # the global generators play no part
    a = [decoder.load(i, 2)[0] for i in range(12)]
    random.seed(456)
    b = [copy.load(i, 2)[0] for i in range(12)]
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    c = [decoder.load(i, 3)[0] for i in range(12)]  # another epoch: other draws
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


def test_tensor_backend_augments_the_direct_crop_with_the_policys_pixels(small_index):
    """The crop is the direct path's (crop_flip_resize_into), then the policy runs on
    it with the draws that follow the crop's and the flip's."""
    from pycls_fast.datasets.images import policies
    from pycls_fast.datasets.images.decode import EncodedImage

    transform = TrainTransform(32, **DEIT)
    plain = TrainTransform(32)
    assert isinstance(transform.augment, policies.RandAugment)
    for seed in range(6):
        image = EncodedImage(small_index.read(seed % len(small_index)))
        got, crop = (np.empty((32, 32, 3), np.uint8) for _ in range(2))
        transform(image, random.Random(seed), got)
        rng = random.Random(seed)
        plain(image, rng, crop)
        want = transform.augment(torch.from_numpy(crop), rng)
        np.testing.assert_array_equal(got, want.numpy())


def test_decoding_threads_run_their_torch_ops_on_one_core(small_index):
    """Each decoding thread sets its own intra-op threads to one, leaving the main
    thread's alone, and starts no OpenMP team (the process's thread count holds)."""
    import os
    import threading

    if torch.get_num_threads() < 2:
        pytest.skip("one intra-op thread already")
    decoder = _decoder(small_index, **DEIT)
    main = torch.get_num_threads()
    seen = {}

    def work():
        tasks = lambda: len(os.listdir("/proc/self/task"))  # noqa: E731
        before = tasks()
        for i in range(20):
            decoder.load(i, 0)
        seen.update(threads=torch.get_num_threads(), grew=tasks() - before)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert seen == {"threads": 1, "grew": 0}
    assert torch.get_num_threads() == main


@pytest.mark.parametrize("kw", [DEIT, DEIT3])
def test_tensor_backend_batches_are_the_same_in_every_loader_mode(kw, tmp_path):
    """The decoder and its transform run in threads ('threads', 'spdl') and travel,
    pickled, to worker processes ('processes', 'subprocess'): the same batches."""
    from pycls_fast.datasets.formats.synthetic import make_image_folder
    from pycls_fast.datasets.loader import construct_train_loader
    from tests.helpers import loader_cfg, one_epoch

    root = make_image_folder(
        str(tmp_path / "data"), ("train",), num_classes=2, images_per_class=6,
        size=(48, 40),
    )  # fmt: skip
    over = {
        "TRAIN__AUGMENT": kw.get("augment", ""),
        "TRAIN__AUGMENT_INTERPOLATION": kw.get("augment_interpolation", "random"),
        "TRAIN__THREE_AUGMENT": kw.get("three_augment", False),
        "TRAIN__COLOR_JITTER": kw.get("color_jitter", 0.0),
    }
    epochs = {}
    for mode, workers in (
        ("threads", 1),
        ("threads", 3),
        ("spdl", 2),
        ("processes", 2),
        ("subprocess", 2),
    ):
        cfg = loader_cfg(root, tmp_path, 2, DATA_LOADER__MODE=mode, **over)
        cfg.DATA_LOADER.NUM_WORKERS = workers
        epochs[mode, workers] = one_epoch(construct_train_loader(cfg), 1)
    reference = epochs["threads", 1]
    for key, batches in epochs.items():
        assert len(batches) == len(reference) == 3, key
        for (x, y), (rx, ry) in zip(batches, reference):
            assert torch.equal(x, rx) and torch.equal(y, ry), key
