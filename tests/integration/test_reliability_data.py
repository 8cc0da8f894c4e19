"""Bad data through the real loaders: every fault is skipped and counted, or a clear
error; never a hang, never a wrong label.

Each class's good images are one solid colour, so an image yielded with another
class's label would show. The fault files sit in the class folders beside them.
"""

import io
import logging
import os
import re
import shutil
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from pycls_fast.datasets.formats.synthetic import make_image_folder
from pycls_fast.datasets.loader import (
    BadImagesError,
    construct_test_loader,
    construct_train_loader,
)
from pycls_fast.errors import UserError
from tests.helpers import loader_cfg, one_epoch

COLOURS = [(200, 30, 30), (30, 200, 30), (30, 30, 200)]
GOOD_PER_CLASS = 6
# Fault files: name -> (class, bad?). A PNG named .JPEG and a 108-megapixel JPEG are
# good images; the rest must be skipped.
FAULTS = {
    "garbage.JPEG": (0, True),
    "truncated.JPEG": (0, True),
    "empty.JPEG": (1, True),
    "png_inside.JPEG": (1, False),
    "text.jpg": (1, True),
    "bomb.png": (2, True),
    "huge.JPEG": (2, False),
}
NUM_FILES = len(COLOURS) * GOOD_PER_CLASS + len(FAULTS)  # 25
BAD = sorted(name for name, (_, bad) in FAULTS.items() if bad)
MODES = ["threads", "processes", "inline"]

pytestmark = [
    pytest.mark.reliability,
    pytest.mark.timeout(60),
    # Pillow warns about the 108-megapixel image (it still decodes it).
    pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning"),
]


JPEG_QUALITY = 90


def _solid(path, label, size=(24, 20), fmt=None):
    Image.new("RGB", size, COLOURS[label]).save(path, format=fmt, quality=JPEG_QUALITY)


def _flat_jpeg_error(quality=JPEG_QUALITY):
    """The most a flat-colour JPEG's decoded, resized pixel strays from its colour,
    in uint8 levels. A flat block keeps only its DC term, quantized by libjpeg's
    quality-scaled DC step q (an error <= q / 16 in the mean); the encoder's and the
    IDCT's roundings to integers add 1/2 each, per component. JFIF's YCbCr -> RGB
    weighs a component by at most 1 (Y) and 1.772 (Cb, into B); the conversion
    rounds (1/2), and a resize of a flat image by weights summing to 1 rounds once
    more (<= 1)."""
    scale = 5000 // quality if quality < 50 else 200 - 2 * quality
    q_luma, q_chroma = ((base * scale + 50) // 100 for base in (16, 17))  # tables' DC

    def component(q):
        return q / 16 + 0.5 + 0.5

    return int(component(q_luma) + 1.772 * component(q_chroma) + 0.5 + 1)


def _png_header_only(width, height):
    """A PNG whose header claims `width` x `height` (valid checksum, no real pixels)."""
    buf = io.BytesIO()
    Image.new("RGB", (4, 4)).save(buf, format="PNG")
    data = bytearray(buf.getvalue())
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return bytes(data)


def _write_split(split_dir, faults, per_class=GOOD_PER_CLASS):
    rng = np.random.default_rng(0)
    for label in range(len(COLOURS)):
        folder = os.path.join(split_dir, f"n{label:08d}")
        os.makedirs(folder)
        for i in range(per_class):
            ext, fmt = (".png", "PNG") if i % 3 == 0 else (".JPEG", "JPEG")
            _solid(os.path.join(folder, f"good_{i}{ext}"), label, fmt=fmt)
    for name in faults:
        path = os.path.join(split_dir, f"n{FAULTS[name][0]:08d}", name)
        _write_fault(path, name, rng)


def _write_fault(path, name, rng):
    label = FAULTS[name][0]
    if name == "garbage.JPEG":
        data = rng.integers(0, 256, 3000, dtype=np.uint8).tobytes()
    elif name == "truncated.JPEG":
        # Noise, so that the cut falls in the compressed pixels, not the headers.
        noise = rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)
        buf = io.BytesIO()
        Image.fromarray(noise).save(buf, format="JPEG")
        data = buf.getvalue()[: len(buf.getvalue()) // 2]
    elif name == "empty.JPEG":
        data = b""
    elif name == "text.jpg":
        data = b"this is a caption, not an image\n"
    elif name == "bomb.png":
        data = _png_header_only(20000, 20000)  # 400 Mpx: over Pillow's limit
    elif name == "png_inside.JPEG":
        return _solid(path, label, fmt="PNG")
    else:  # huge.JPEG: 12000 x 9000, one colour, so ~1.7 MB on disk
        return _solid(path, label, size=(12000, 9000), fmt="JPEG")
    with open(path, "wb") as f:
        f.write(data)


@pytest.fixture(scope="module")
def faulty_root(tmp_path_factory):
    """`train` with every fault of FAULTS; `val` with one garbage file, sorted last."""
    root = tmp_path_factory.mktemp("faulty")
    _write_split(str(root / "train"), FAULTS)
    _write_split(str(root / "val"), [])
    with open(root / "val" / "n00000002" / "zz_garbage.JPEG", "wb") as f:
        f.write(b"\xff\xd8\xff\xe0 not really")
    return str(root)


@pytest.fixture(scope="module")
def clean_root(tmp_path_factory):
    """`train` with good images only: 20 per class, so 30 batches of 2."""
    root = tmp_path_factory.mktemp("clean")
    _write_split(str(root / "train"), [], per_class=20)
    return str(root)


def _cfg(root, tmp_path, mode, **over):
    mine = {
        "TRAIN__IM_SIZE": 16, "TEST__IM_SIZE": 18, "TRAIN__BATCH_SIZE": 5,
        "DATA_LOADER__MODE": "threads" if mode == "inline" else mode,
        "DATA_LOADER__NUM_WORKERS": 0 if mode == "inline" else 2,
        "DATA_LOADER__MAX_BAD_FRAC": 0.25,
    }  # fmt: skip
    return loader_cfg(root, tmp_path, len(COLOURS), **{**mine, **over})


def _assert_colours_match_labels(batches):
    """Every pixel of every image is its label's colour (JPEG error aside)."""
    bound = _flat_jpeg_error()
    for images, labels in batches:
        for image, label in zip(images, labels.tolist()):
            expected = np.array(COLOURS[label]).reshape(3, 1, 1)
            assert np.abs(image.numpy().astype(int) - expected).max() <= bound, label


def _bad_names(loader):
    return sorted(os.path.basename(path) for path, _ in loader.bad_images)


@pytest.mark.parametrize("mode", MODES)
def test_bad_files_skipped_counted_logged_labels_right(
    faulty_root, tmp_path, caplog, mode
):
    loader = construct_train_loader(_cfg(faulty_root, tmp_path, mode))
    assert len(loader) == NUM_FILES // 5  # every file is planned: 5 batches of 5
    with caplog.at_level(logging.WARNING, logger="pycls_fast.datasets.loader"):
        batches = one_epoch(loader)
    good = NUM_FILES - len(BAD)
    assert sum(len(y) for _, y in batches) == good == loader.stats()["images"]
    assert loader.stats()["bad_images"] == len(BAD) == 5
    assert _bad_names(loader) == BAD  # the PNG named .JPEG and the huge JPEG decode
    _assert_colours_match_labels(batches)
    labels = np.concatenate([y.numpy() for _, y in batches])
    # 6 solid images per class, plus the PNG named .JPEG (1) and the huge JPEG (2).
    assert np.bincount(labels).tolist() == [6, 7, 7]
    for path, _ in loader.bad_images:
        assert f"skipped bad image {path} (" in caplog.text
    errors = dict((os.path.basename(p), e) for p, e in loader.bad_images)
    assert errors["bomb.png"].startswith("DecompressionBombError: Image size (4000")
    assert errors["empty.JPEG"].startswith("UnidentifiedImageError")
    assert errors["truncated.JPEG"].startswith("OSError")


@pytest.mark.parametrize("mode", MODES)
def test_too_many_bad_files_abort_naming_the_fraction(faulty_root, tmp_path, mode):
    cfg = _cfg(faulty_root, tmp_path, mode, DATA_LOADER__MAX_BAD_FRAC=0.1)
    loader = construct_train_loader(cfg)
    # 10% of 25 allows 2.5 bad images: the third one aborts.
    with pytest.raises(BadImagesError) as info:
        one_epoch(loader)
    message = str(info.value)
    assert message.startswith("3 images of 25 (12.0%) failed to decode in epoch 0")
    assert "more than DATA_LOADER.MAX_BAD_FRAC (0.1) allows; first: " in message
    assert os.path.basename(message.split("first: ")[1]) in BAD
    assert isinstance(info.value, UserError)  # tools exit with status 2
    # The loader stopped its threads / workers: a fresh epoch runs (and aborts) again.
    with pytest.raises(BadImagesError):
        one_epoch(loader, 1)


@pytest.mark.parametrize("mode", MODES)
def test_files_vanishing_mid_epoch_skipped_and_logged(
    clean_root, tmp_path, caplog, mode
):
    root = str(tmp_path / "data")
    shutil.copytree(clean_root, root)
    cfg = _cfg(
        root,
        tmp_path,
        mode,
        TRAIN__BATCH_SIZE=2,
        DATA_LOADER__NUM_WORKERS=0 if mode == "inline" else 1,
        DATA_LOADER__PREFETCH=1,
    )
    loader = construct_train_loader(cfg)
    loader.set_epoch(0)
    plan = loader.plan(0)
    # The loader reads ahead by a bounded number of batches (about 12 here, set by
    # its queue sizes): the last two batches are read after the first is consumed.
    assert len(plan) == 30
    # One image of each of the last two batches: one deleted, one replaced by a
    # folder of the same name (as unreadable as a file without read permission).
    gone = loader.decoder.index.path(plan[-1][0])
    swapped = loader.decoder.index.path(plan[-2][1])
    batches = []
    with caplog.at_level(logging.WARNING, logger="pycls_fast.datasets.loader"):
        for images, labels in loader:
            if not batches:
                os.remove(gone)
                os.remove(swapped)
                os.mkdir(swapped)
            batches.append((images.clone(), labels.clone()))
    assert [len(y) for _, y in batches] == [2] * 28 + [1, 1]
    assert loader.stats()["bad_images"] == 2
    assert sorted(p for p, _ in loader.bad_images) == sorted([gone, swapped])
    errors = sorted(e.split(":")[0] for _, e in loader.bad_images)
    assert errors == ["FileNotFoundError", "IsADirectoryError"]
    assert gone in caplog.text and swapped in caplog.text
    _assert_colours_match_labels(batches)


@pytest.mark.parametrize("mode", MODES)
def test_eval_drops_all_bad_batch_and_counts_every_good_image(
    faulty_root, tmp_path, mode
):
    # val: 18 good images, then one garbage file alone in the last batch of 6.
    cfg = _cfg(faulty_root, tmp_path, mode, TEST__BATCH_SIZE=6)
    loader = construct_test_loader(cfg)
    assert len(loader) == 4
    batches = one_epoch(loader)
    assert [len(y) for _, y in batches] == [6, 6, 6]  # no empty batch
    assert loader.stats()["bad_images"] == 1
    assert _bad_names(loader) == ["zz_garbage.JPEG"]
    labels = np.concatenate([y.numpy() for _, y in batches])
    assert np.bincount(labels).tolist() == [GOOD_PER_CLASS] * 3
    _assert_colours_match_labels(batches)


def test_train_batch_of_only_bad_images_is_yielded_empty(faulty_root, tmp_path):
    # Batches of one: each bad file is a batch on its own; ranks must stay in step.
    cfg = _cfg(faulty_root, tmp_path, "threads", TRAIN__BATCH_SIZE=1)
    batches = one_epoch(construct_train_loader(cfg))
    sizes = [len(y) for _, y in batches]
    assert len(sizes) == NUM_FILES and sizes.count(0) == len(BAD)
    empty = next(x for x, y in batches if len(y) == 0)
    assert empty.shape == (0, 3, 16, 16)


@pytest.mark.parametrize("split", ["train", "val"])
def test_class_folder_emptied_after_cached_index_is_named(clean_root, tmp_path, split):
    root = str(tmp_path / "data")
    shutil.copytree(clean_root, root)
    cfg = _cfg(root, tmp_path, "threads", TEST__SPLIT="train")
    construct = construct_train_loader if split == "train" else construct_test_loader
    construct(cfg)  # builds and caches the index
    folder = os.path.join(root, "train", "n00000001")
    for name in os.listdir(folder):
        os.remove(os.path.join(folder, name))
    with pytest.raises(
        UserError, match=f"class folder has no images .*: {re.escape(folder)}$"
    ):
        construct(cfg)


def test_fuzzed_image_files_never_escape_as_errors(tmp_path):
    """Seeded byte flips, cuts and insertions in JPEG and PNG files: each file decodes
    or is skipped; nothing else is raised and no image is lost or mislabelled."""
    root = str(tmp_path / "fuzz")
    make_image_folder(
        root, splits=("train",), num_classes=2, images_per_class=20, size=(40, 30)
    )
    rng = np.random.default_rng(1)
    folder = os.path.join(root, "train", "n00000001")
    for i, name in enumerate(sorted(os.listdir(folder))):
        path = os.path.join(folder, name)
        if i % 2:
            Image.open(path).save(path, format="PNG")  # still named .JPEG
        with open(path, "rb") as f:
            data = bytearray(f.read())
        for _ in range(1 + i % 3):
            at = int(rng.integers(len(data)))
            op = i % 3
            if op == 0:
                data[at] = int(rng.integers(256))
            elif op == 1:
                del data[max(at, 2) :]
            else:
                data[at:at] = rng.integers(0, 256, 4, dtype=np.uint8).tobytes()
        with open(path, "wb") as f:
            f.write(bytes(data))
    cfg = _cfg(root, tmp_path, "threads", TRAIN__BATCH_SIZE=8)
    cfg.MODEL.NUM_CLASSES = 2
    cfg.DATA_LOADER.MAX_BAD_FRAC = 1.0
    loader = construct_train_loader(cfg)
    batches = one_epoch(loader)
    labels = np.concatenate([y.numpy() for _, y in batches])
    bad = loader.stats()["bad_images"]
    assert len(labels) + bad == 40
    assert 0 < bad <= 20 and (labels == 0).sum() == 20  # class 0 untouched
    assert all("n00000001" in p for p, _ in loader.bad_images)
