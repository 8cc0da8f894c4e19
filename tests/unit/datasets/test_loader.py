"""Loader constructors: ranks, epochs, modes, bad images, errors."""

import logging
import os
import shutil

import numpy as np
import pytest
import torch

from pycls_fast.config import ConfigError
from pycls_fast.datasets import loader as loader_module
from pycls_fast.datasets.formats.synthetic import make_image_folder
from pycls_fast.datasets.loader import (
    BadImagesError,
    construct_test_loader,
    construct_train_loader,
)
from pycls_fast.errors import UserError
from tests.helpers import loader_cfg, one_epoch

NUM_CLASSES, PER_CLASS = 3, 6  # 18 images per split


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("imagenet"))
    return make_image_folder(
        root, num_classes=NUM_CLASSES, images_per_class=PER_CLASS, size=(48, 40)
    )


def _cfg(root, tmp_path, **over):
    return loader_cfg(root, tmp_path, NUM_CLASSES, **over)


def test_train_batches_shape_dtype_and_len(data_root, tmp_path):
    loader = construct_train_loader(_cfg(data_root, tmp_path))
    batches = one_epoch(loader)
    assert len(loader) == len(batches) == 18 // 4
    images, labels = batches[0]
    assert images.shape == (4, 3, 32, 32) and images.dtype == torch.uint8
    assert labels.dtype == torch.int64 and labels.max() < NUM_CLASSES
    assert images.is_contiguous(memory_format=torch.channels_last)
    stats = loader.stats()
    assert stats["images"] == 16 and stats["bad_images"] == 0
    assert 0.0 <= stats["data_wait_frac"] <= 1.0 and stats["img_per_s"] > 0


def test_two_ranks_disjoint_equal_and_deterministic(data_root, tmp_path):
    cfg = _cfg(data_root, tmp_path, TRAIN__BATCH_SIZE=4)  # 2 images per rank
    loaders = [construct_train_loader(cfg, rank=r, world_size=2) for r in (0, 1)]
    assert len(loaders[0]) == len(loaders[1]) == 18 // 2 // 2
    # The images a rank reads, as index arrays: disjoint, and the same on a rerun.
    plans = [np.concatenate(lo.plan(5)) for lo in loaders]
    assert not set(plans[0]) & set(plans[1])
    a = one_epoch(loaders[0], 5)
    b = one_epoch(construct_train_loader(cfg, rank=0, world_size=2), 5)
    assert all(
        torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b)
    )
    c = one_epoch(loaders[0], 6)
    assert not all(torch.equal(x[0], y[0]) for x, y in zip(a, c))
    assert a[0][0].shape[0] == 2


def test_deit_pieces_keep_modes_identical_and_ranks_one_process(data_root, tmp_path):
    over = {"DATA__TRAIN_CROP": "simple_random", "TRAIN__THREE_AUGMENT": True,
            "TRAIN__COLOR_JITTER": 0.3, "TRAIN__REPEATED_AUG": 3}  # fmt: skip
    cfg = _cfg(data_root, tmp_path, **over)
    threads = one_epoch(construct_train_loader(cfg), 1)
    cfg.DATA_LOADER.MODE = "processes"
    procs = one_epoch(construct_train_loader(cfg), 1)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(threads, procs))
    # Two ranks: each image decoded exactly as one process decodes it.
    cfg.DATA_LOADER.MODE = "threads"
    whole = construct_train_loader(cfg)
    plan = np.concatenate(whole.plan(1))
    images = torch.cat([x for x, _ in threads])
    by_index = dict(zip(plan.tolist(), images))
    # Repeated augmentation: copies of one image (virtual indices i + c x N) carry
    # its label and are augmented apart.
    n = NUM_CLASSES * PER_CLASS
    copies = [v for v in plan.tolist() if v >= n and v - n in by_index]
    assert copies and all(not torch.equal(by_index[v], by_index[v - n]) for v in copies)
    labels = torch.cat([y for _, y in threads])
    label_of = dict(zip(plan.tolist(), labels.tolist()))
    assert all(label_of[v] == label_of[v - n] for v in copies)
    for r in (0, 1):
        loader = construct_train_loader(cfg, rank=r, world_size=2)
        mine = np.concatenate(loader.plan(1))
        got = torch.cat([x for x, _ in one_epoch(loader, 1)])
        for i, x in zip(mine.tolist(), got):
            assert torch.equal(x, by_index[i])


def test_all_modes_yield_identical_batches(data_root, tmp_path):
    threads = one_epoch(construct_train_loader(_cfg(data_root, tmp_path)), 2)
    inline = one_epoch(
        construct_train_loader(_cfg(data_root, tmp_path, DATA_LOADER__NUM_WORKERS=0)), 2
    )
    assert len(threads) == len(inline) == 4
    for mode in ("spdl", "processes", "subprocess"):
        cfg = _cfg(data_root, tmp_path, DATA_LOADER__MODE=mode)
        other = one_epoch(construct_train_loader(cfg), 2)
        assert len(other) == 4
        for (x, y), (p, q), (s, t) in zip(threads, other, inline):
            assert torch.equal(x, p) and torch.equal(y, q)
            assert torch.equal(x, s) and torch.equal(y, t)


def test_auto_mode_is_the_measured_best_for_the_device(
    data_root, tmp_path, monkeypatch, caplog
):
    assert loader_module.resolve_mode("auto", "cuda") == "subprocess"
    assert loader_module.resolve_mode("auto", "cpu") == "threads"
    assert loader_module.resolve_mode("auto", "xpu") == "threads"  # not measured
    assert loader_module.resolve_mode("spdl", "cuda") == "spdl"  # named: as named
    cfg = _cfg(data_root, tmp_path)
    assert cfg.DATA_LOADER.MODE == "auto"  # the default
    with caplog.at_level(logging.INFO, logger=loader_module.__name__):
        assert construct_train_loader(cfg).mode == "threads"
        assert construct_test_loader(cfg).mode == "threads"
    # Said once, for the training loader.
    assert (
        caplog.text.count("data loader: threads mode (DATA_LOADER.MODE auto on cpu)")
        == 1
    )
    # Where the step runs on a GPU, both loaders are the child-process one.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert construct_train_loader(cfg).mode == "subprocess"
    assert construct_test_loader(cfg).mode == "subprocess"
    cfg.DATA_LOADER.MODE = "threads"
    assert construct_train_loader(cfg).mode == "threads"


@pytest.mark.parametrize("mode", ["threads", "spdl", "processes", "subprocess"])
def test_with_plan_yields_the_fixed_batches_in_that_mode(data_root, tmp_path, mode):
    loader = construct_train_loader(_cfg(data_root, tmp_path))
    plan = [np.array([5, 0, 17]), np.array([3, 3])]
    fixed = loader.with_plan(plan, mode)
    assert fixed.mode == mode and fixed.decoder is loader.decoder
    assert loader.mode == "threads" and len(loader) == 4  # the original is unchanged
    labels = loader.decoder.index.labels
    for epoch in (0, 3):  # the same batches every epoch; crops follow the epoch
        got = one_epoch(fixed, epoch)
        assert [len(y) for _, y in got] == [3, 2]
        for (_, y), b in zip(got, plan):
            assert torch.equal(y, torch.as_tensor(labels[b], dtype=torch.int64))
    # Same images and crops as the default mode on the same plan.
    ref = one_epoch(loader.with_plan(plan), 3)
    assert all(torch.equal(x, p) for (x, _), (p, _) in zip(ref, got))


def test_with_plan_rejects_bad_modes_and_indices(data_root, tmp_path):
    loader = construct_train_loader(_cfg(data_root, tmp_path))
    with pytest.raises(ValueError, match="mode must be one of"):
        loader.with_plan([np.arange(4)], "fork")
    with pytest.raises(ValueError, match=r"indices in \[0, 18\)"):
        loader.with_plan([np.array([0, 18])])
    with pytest.raises(ValueError, match="1-d array"):
        loader.with_plan([np.zeros((2, 2), dtype=np.int64)])
    assert len(loader.with_plan([])) == 0


def test_test_split_covered_once_across_ranks(data_root, tmp_path):
    cfg = _cfg(data_root, tmp_path, TEST__BATCH_SIZE=8)  # 4 per rank
    seen = []
    for rank in (0, 1):
        loader = construct_test_loader(cfg, rank=rank, world_size=2)
        batches = one_epoch(loader)
        assert [len(y) for _, y in batches] == [4, 4, 1]
        seen += [y for _, y in batches]
    labels = torch.cat(seen)
    assert torch.bincount(labels).tolist() == [PER_CLASS] * NUM_CLASSES
    # Center crops are deterministic: a second pass gives the same pixels.
    again = one_epoch(construct_test_loader(cfg, rank=0, world_size=2), 7)
    first = one_epoch(construct_test_loader(cfg, rank=0, world_size=2), 0)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(again, first))


def _corrupt(root, tmp_path):
    """A copy of the train split with one truncated and one garbage .JPEG."""
    bad_root = str(tmp_path / "bad")
    make_image_folder(
        bad_root, splits=("train",), num_classes=2, images_per_class=8, size=(48, 40)
    )
    victim = os.path.join(bad_root, "train", "n00000001", "train_0001_000003.JPEG")
    with open(victim, "rb") as f:
        data = f.read()
    with open(victim, "wb") as f:
        f.write(data[: len(data) // 3])  # truncated
    with open(os.path.join(bad_root, "train", "n00000000", "zz.JPEG"), "wb") as f:
        f.write(b"not a jpeg at all")
    return bad_root, victim


@pytest.mark.parametrize("mode", ["threads", "spdl", "processes", "subprocess"])
def test_corrupt_images_skipped_counted_logged(tmp_path, caplog, mode):
    bad_root, victim = _corrupt(None, tmp_path)
    cfg = _cfg(bad_root, tmp_path, TRAIN__BATCH_SIZE=17, DATA_LOADER__MAX_BAD_FRAC=0.2)
    cfg.MODEL.NUM_CLASSES = 2
    cfg.DATA_LOADER.MODE = mode
    loader = construct_train_loader(cfg)
    with caplog.at_level(logging.WARNING, logger="pycls_fast.datasets.loader"):
        batches = one_epoch(loader)
    assert [len(y) for _, y in batches] == [15]  # 17 images, 2 skipped
    assert batches[0][0].shape == (15, 3, 32, 32)
    assert loader.stats()["bad_images"] == 2
    assert sorted(os.path.basename(p) for p, _ in loader.bad_images) == [
        "train_0001_000003.JPEG",
        "zz.JPEG",
    ]
    assert victim in caplog.text


def test_too_many_bad_images_abort(tmp_path):
    bad_root, _ = _corrupt(None, tmp_path)
    cfg = _cfg(bad_root, tmp_path, TRAIN__BATCH_SIZE=17, DATA_LOADER__MAX_BAD_FRAC=0.1)
    cfg.MODEL.NUM_CLASSES = 2
    with pytest.raises(BadImagesError, match=r"2 images .*MAX_BAD_FRAC \(0.1\)"):
        one_epoch(construct_train_loader(cfg))


def test_user_errors(data_root, tmp_path):
    with pytest.raises(UserError, match="DATA.PATH is not set"):
        construct_train_loader(_cfg("", tmp_path))
    with pytest.raises(ConfigError, match="MODEL.NUM_CLASSES"):
        construct_train_loader(_cfg(data_root, tmp_path, MODEL__NUM_CLASSES=2))
    with pytest.raises(UserError, match="fewer than one batch"):
        construct_train_loader(_cfg(data_root, tmp_path, TRAIN__BATCH_SIZE=64))
    with pytest.raises(ConfigError, match="TRAIN.BATCH_SIZE"):
        construct_train_loader(_cfg(data_root, tmp_path), rank=0, world_size=3)


def test_test_classes_must_match_train(tmp_path):
    root = str(tmp_path / "mismatch")
    make_image_folder(
        root, splits=("train",), num_classes=3, images_per_class=2, size=(40, 40)
    )
    make_image_folder(
        root, splits=("val",), num_classes=2, images_per_class=2, size=(40, 40)
    )
    with pytest.raises(UserError) as e:
        construct_test_loader(_cfg(root, tmp_path))
    val, train = os.path.join(root, "val"), os.path.join(root, "train")
    assert str(e.value) == (
        f"class folders of {val} differ from those of {train} (only in train: "
        "n00000002): labels would name other classes"
    )
    # A stray folder among the train split's classes, past MODEL.NUM_CLASSES: named
    # as the stray it is, not as too few classes.
    make_image_folder(
        root, splits=("val",), num_classes=3, images_per_class=2, size=(40, 40)
    )
    stray = os.path.join(val, "n00000001 copy")
    shutil.copytree(os.path.join(val, "n00000001"), stray)
    with pytest.raises(UserError, match=r"\(only here: n00000001 copy\)"):
        construct_test_loader(_cfg(root, tmp_path))
    shutil.rmtree(stray)
    construct_test_loader(_cfg(root, tmp_path))


def test_index_cache_written_in_out_dir(data_root, tmp_path):
    cfg = _cfg(data_root, tmp_path)
    construct_train_loader(cfg)
    assert len(os.listdir(os.path.join(cfg.OUT_DIR, "data_index"))) == 1
    cfg.DATA.INDEX_CACHE = False
    cfg.OUT_DIR = str(tmp_path / "no_cache")
    construct_train_loader(cfg)
    assert not os.path.exists(cfg.OUT_DIR)


def test_resume_mid_epoch_skips_batches(data_root, tmp_path):
    loader = construct_train_loader(_cfg(data_root, tmp_path))
    full = one_epoch(loader, 4)
    loader.set_epoch(4, start_batch=3)
    assert len(loader) == 1
    rest = [(x.clone(), y.clone()) for x, y in loader]
    assert len(rest) == 1 and torch.equal(rest[0][0], full[3][0])
    loader.set_epoch(5)
    assert len(loader) == 4


def test_stage_stats_logged_on_request(data_root, tmp_path, caplog):
    loader = construct_train_loader(
        _cfg(data_root, tmp_path, DATA_LOADER__STATS_PERIOD=1e-9)
    )
    with caplog.at_level(logging.INFO, logger="pycls_fast.datasets.modes.threaded"):
        one_epoch(loader)
    lines = [r.getMessage() for r in caplog.records if r.name.endswith("threaded")]
    # One line per batch at this period; the first covers the 4 images of batch 1
    # (tasks of later batches may have finished too).
    assert len(lines) == 4 and all("threads busy" in line for line in lines)
    assert "ready batches" in lines[0] and " of 4 on average" in lines[0]
    caplog.clear()
    loader = construct_train_loader(
        _cfg(
            data_root,
            tmp_path,
            DATA_LOADER__STATS_PERIOD=0.01,
            DATA_LOADER__MODE="spdl",
        )
    )
    with caplog.at_level(logging.INFO, logger="spdl.pipeline"):
        one_epoch(loader)
    assert "decode_chunk" in caplog.text and "Occupancy rate" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO):
        one_epoch(construct_train_loader(_cfg(data_root, tmp_path)))
        one_epoch(
            construct_train_loader(_cfg(data_root, tmp_path, DATA_LOADER__MODE="spdl"))
        )
    assert "threads busy" not in caplog.text  # off by default
    assert "Occupancy rate" not in caplog.text


@pytest.mark.parametrize("mode", ["threads", "processes", "subprocess"])
def test_replaced_bad_images_keep_batches_full_and_counted(tmp_path, mode):
    bad_root, victim = _corrupt(None, tmp_path)
    cfg = _cfg(bad_root, tmp_path, TRAIN__BATCH_SIZE=17, DATA_LOADER__MAX_BAD_FRAC=0.2)
    cfg.MODEL.NUM_CLASSES = 2
    cfg.DATA_LOADER.REPLACE_BAD = True
    cfg.DATA_LOADER.MODE = mode
    loader = construct_train_loader(cfg)
    (batch,) = one_epoch(loader)
    assert batch[0].shape == (17, 3, 32, 32)  # full: two images stood in
    assert loader.stats()["bad_images"] >= 2
    assert victim in {p for p, _ in loader.bad_images}
    # The stand-ins are good images of the split, each with its own label and crop
    # (decoded as virtual copies): the same in every mode and run.
    cfg.DATA_LOADER.MODE = "threads"
    (again,) = one_epoch(construct_train_loader(cfg))
    assert torch.equal(batch[0], again[0]) and torch.equal(batch[1], again[1])
    plan = construct_train_loader(cfg).plan(0)[0]
    index = loader.decoder.index
    bad_rows = [r for r, i in enumerate(plan) if index.path(i % len(index)).endswith(
        ("zz.JPEG", os.path.basename(victim)))]  # fmt: skip
    assert len(bad_rows) == 2
    labels = index.labels
    for r in range(17):
        if r not in bad_rows:
            assert batch[1][r] == labels[plan[r] % len(index)]
    # A test loader never replaces: every image is evaluated once, or not at all.
    assert not loader_module._decoder(cfg, index, train=False).replace_bad
    # CUDA graphs replay fixed shapes: their training batches are always full.
    cfg.DATA_LOADER.REPLACE_BAD, cfg.TRAIN.CUDA_GRAPHS = False, True
    assert loader_module._decoder(cfg, index, train=True).replace_bad
