"""Tar shards: packing (format, resume), the index, the epoch order, and the loader on
shards (ranks, exact resume, modes, bad images)."""

import logging
import os
import tarfile

import numpy as np
import pytest
import torch

from pycls_fast.datasets.formats.index import load_index
from pycls_fast.datasets.formats.pack import pack_split, shard_name
from pycls_fast.datasets.formats.shards import load_shard_index
from pycls_fast.datasets.formats.synthetic import make_image_folder
from pycls_fast.datasets.loader import construct_test_loader, construct_train_loader
from pycls_fast.datasets.modes import sharding
from pycls_fast.errors import UserError
from tests.helpers import loader_cfg, one_epoch

NUM_CLASSES, PER_CLASS = 3, 8  # 24 images per split
SHARD_BYTES = 5000  # a few images per shard


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("folder"))
    return make_image_folder(
        root, num_classes=NUM_CLASSES, images_per_class=PER_CLASS, size=(48, 40)
    )


@pytest.fixture(scope="module")
def packed(folder, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("shards"))
    for split in ("train", "val"):
        pack_split(load_index(folder, split), out, split, SHARD_BYTES, seed=3)
    return out


def _cfg(root, tmp_path, **over):
    shards = {"DATA__FORMAT": "shards", "DATA__SHUFFLE_BUFFER": 8}
    return loader_cfg(root, tmp_path, NUM_CLASSES, **{**shards, **over})


def test_every_image_packed_once_with_its_bytes_and_label(folder, packed):
    files = load_index(folder, "train")
    shards = load_shard_index(packed, "train")
    assert len(shards) == len(files) == NUM_CLASSES * PER_CLASS
    assert shards.classes == files.classes
    assert len(shards.shard_names) > 3 and shards.counts.sum() == len(shards)
    by_bytes = {files.read(i): int(files.labels[i]) for i in range(len(files))}
    got = {shards.read(i): int(shards.labels[i]) for i in range(len(shards))}
    assert got == by_bytes
    # Each shard's images are a contiguous run of indices, in offset order.
    assert (np.diff(shards.shard) >= 0).all()


def test_shards_are_webdataset_tars(packed):
    # WebDataset groups members by key (the name up to the first dot of the base
    # name): each image has its .cls with the label in ASCII.
    shards = load_shard_index(packed, "train")
    with tarfile.open(shards.shard_path(0)) as tar:
        members = tar.getmembers()
        names = [m.name for m in members]
        assert len(names) == 2 * shards.counts[0]
        for image, cls in zip(names[::2], names[1::2]):
            key, ext = image.split(".", 1)
            assert ext == "jpeg" and cls == f"{key}.cls"
            assert int(tar.extractfile(cls).read()) == shards.classes.index(
                key.split("/")[0]
            )
    assert shards.path(0).startswith(shards.shard_path(0) + ":n0000000")


def test_epoch_order_is_a_windowed_shuffle_of_permuted_shards():
    counts = np.array([5, 7, 3, 6, 4])
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    a = sharding.shard_order(counts, seed=1, epoch=2, window=6)
    assert sorted(a.tolist()) == list(range(counts.sum()))
    assert np.array_equal(a, sharding.shard_order(counts, 1, 2, 6))
    assert not np.array_equal(a, sharding.shard_order(counts, 1, 3, 6))
    # Window by window, the images come from the shards in one permuted order: each
    # window holds exactly the next 6 images of the concatenated shard sequence.
    shard_of = np.searchsorted(starts, a, side="right") - 1
    order = list(dict.fromkeys(shard_of.tolist()))
    assert sorted(order) == list(range(5))
    sequence = np.concatenate(
        [np.arange(starts[s], starts[s] + counts[s]) for s in order]
    )
    for w in range(0, len(a), 6):
        assert sorted(a[w : w + 6]) == sorted(sequence[w : w + 6])


def test_ranks_together_see_one_process_batches(packed, tmp_path):
    one = construct_train_loader(_cfg(packed, tmp_path), rank=0, world_size=1)
    two = [
        construct_train_loader(_cfg(packed, tmp_path), rank=r, world_size=2)
        for r in (0, 1)
    ]
    for epoch in (0, 1):
        plans = [lo.plan(epoch) for lo in two]
        for whole, a, b in zip(one.plan(epoch), *plans):
            assert sorted(whole) == sorted(np.concatenate([a, b]))
    # Epochs differ, and the images of an epoch are each read at most once.
    assert not np.array_equal(one.plan(0)[0], one.plan(1)[0])
    assert len(set(np.concatenate(one.plan(0)).tolist())) == 24


def test_resume_mid_epoch_is_exact_in_all_modes(packed, tmp_path):
    cfg = _cfg(packed, tmp_path)
    full = one_epoch(construct_train_loader(cfg), 3)
    assert len(full) == 6
    for mode in ("threads", "spdl", "processes"):
        cfg.DATA_LOADER.MODE = mode
        loader = construct_train_loader(cfg)
        loader.set_epoch(3, start_batch=4)
        rest = [(x.clone(), y.clone()) for x, y in loader]
        assert len(rest) == 2
        for (x, y), (fx, fy) in zip(rest, full[4:]):
            assert torch.equal(x, fx) and torch.equal(y, fy)


def test_test_split_covered_once(packed, tmp_path):
    cfg = _cfg(packed, tmp_path)
    labels = [y for r in (0, 1) for _, y in one_epoch(construct_test_loader(cfg, r, 2))]
    assert sum(len(y) for y in labels) == 24
    assert torch.cat(labels).bincount().tolist() == [PER_CLASS] * NUM_CLASSES


def test_bad_image_in_a_shard_is_skipped_and_named(folder, tmp_path, caplog):
    root = make_image_folder(
        str(tmp_path / "bad"), splits=("train",), num_classes=2, images_per_class=8,
        size=(48, 40),
    )  # fmt: skip
    with open(os.path.join(root, "train", "n00000001", "zz.JPEG"), "wb") as f:
        f.write(b"not a jpeg")
    pack_split(load_index(root, "train"), str(tmp_path / "sh"), "train", SHARD_BYTES)
    cfg = _cfg(str(tmp_path / "sh"), tmp_path, TRAIN__BATCH_SIZE=17)
    cfg.MODEL.NUM_CLASSES, cfg.DATA_LOADER.MAX_BAD_FRAC = 2, 0.1
    loader = construct_train_loader(cfg)
    with caplog.at_level(logging.WARNING, logger="pycls_fast.datasets.loader"):
        batches = one_epoch(loader)
    assert [len(y) for _, y in batches] == [16]
    assert loader.stats()["bad_images"] == 1
    assert loader.bad_images[0][0].endswith(".tar:n00000001/zz.jpeg")
    assert "zz.jpeg" in caplog.text


def test_packing_resumes_after_an_interruption(folder, tmp_path):
    index = load_index(folder, "train")
    full = str(tmp_path / "full")
    pack_split(index, full, "train", SHARD_BYTES, seed=5)
    # An interrupted run: two shards finished, the index not yet written.
    part = tmp_path / "part" / "train"
    part.mkdir(parents=True)
    for k in (0, 1):
        name = shard_name("train", k)
        os.link(os.path.join(full, "train", name), part / name)
    before = os.stat(part / shard_name("train", 0)).st_ino
    progress = []
    pack_split(index, str(tmp_path / "part"), "train", SHARD_BYTES, 5,
               lambda done, total: progress.append(done))  # fmt: skip
    assert os.stat(part / shard_name("train", 0)).st_ino == before  # kept
    for name in sorted(os.listdir(os.path.join(full, "train"))):
        with (
            open(os.path.join(full, "train", name), "rb") as a,
            open(part / name, "rb") as b,
        ):
            assert a.read() == b.read(), name
    assert progress[-1] == len(index)
    with pytest.raises(UserError, match="other images than this run"):
        pack_split(index, str(tmp_path / "part"), "train", SHARD_BYTES, seed=6)


def test_user_errors(folder, tmp_path):
    with pytest.raises(UserError, match="no shards.json in .*train.*pack_dataset"):
        construct_train_loader(_cfg(folder, tmp_path))
    cfg = _cfg("s3://bucket/imagenet", tmp_path, DATA__FORMAT="folder")
    with pytest.raises(UserError, match="is remote: read it as DATA.FORMAT shards"):
        construct_train_loader(cfg)
