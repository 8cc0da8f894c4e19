"""Folder index: layout, labels, bad layouts, cache."""

import os
import tracemalloc

import numpy as np
import pytest
from PIL import Image

from pycls_fast.datasets.formats.index import load_index, scan_split
from pycls_fast.errors import UserError


def _touch_image(path, mode="RGB", fmt=None):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    Image.new(mode, (8, 8)).save(path, format=fmt)


def _layout(root):
    # Classes deliberately created out of order; one non-image file; mixed extensions.
    _touch_image(f"{root}/train/n02/b.JPEG", fmt="JPEG")
    _touch_image(f"{root}/train/n02/a.jpg", fmt="JPEG")
    _touch_image(f"{root}/train/n01/c.png")
    _touch_image(f"{root}/train/n01/d.jpeg", fmt="JPEG")
    _touch_image(f"{root}/train/n03/e.PNG", fmt="PNG")
    with open(f"{root}/train/n01/notes.txt", "w") as f:
        f.write("not an image")
    return root


def test_classes_sorted_and_labels(tmp_path):
    index = scan_split(_layout(str(tmp_path)) + "/train")
    assert index.classes == ["n01", "n02", "n03"]
    split = os.path.join(str(tmp_path), "train")
    rel = [os.path.relpath(index.path(i), split) for i in range(len(index))]
    assert rel == ["n01/c.png", "n01/d.jpeg", "n02/a.jpg", "n02/b.JPEG", "n03/e.PNG"]
    assert index.names.dtype.kind == "S" and index.labels.dtype == np.int32
    assert index.labels.tolist() == [0, 0, 1, 1, 2]
    assert index.path(2) == os.path.join(str(tmp_path), "train", "n02", "a.jpg")


def test_missing_root_and_split(tmp_path):
    with pytest.raises(UserError, match="DATA.PATH is not set"):
        load_index("", "train")
    with pytest.raises(UserError, match="DATA.PATH folder not found: .*nowhere"):
        load_index(str(tmp_path / "nowhere"), "train")
    with pytest.raises(UserError, match=r"split folder not found: .*[/\\]val"):
        load_index(str(tmp_path), "val")


def test_a_relative_data_path_says_relative_to_what(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError) as e:
        load_index("data/digits", "train")
    assert str(e.value) == (
        f"DATA.PATH folder not found: data/digits (relative to {tmp_path})"
    )
    with pytest.raises(UserError) as e:  # an absolute path needs no such note
        load_index(str(tmp_path / "x"), "train")
    assert str(e.value) == f"DATA.PATH folder not found: {tmp_path / 'x'}"


def test_split_without_class_folders(tmp_path):
    _touch_image(f"{tmp_path}/val/flat.JPEG", fmt="JPEG")
    with pytest.raises(UserError, match=r"no class folders in .*val"):
        load_index(str(tmp_path), "val")


def test_empty_class_folder_is_named(tmp_path):
    _layout(str(tmp_path))
    os.makedirs(f"{tmp_path}/train/n04")
    with open(f"{tmp_path}/train/n04/readme.txt", "w") as f:
        f.write("x")
    with pytest.raises(UserError, match=r"no images.*: .*n04"):
        load_index(str(tmp_path), "train")


def test_cache_reused_and_invalidated(tmp_path):
    root, cache = _layout(str(tmp_path / "data")), str(tmp_path / "cache")
    first = load_index(root, "train", cache)
    files = os.listdir(cache)
    assert len(files) == 1 and files[0].endswith(".npz")
    # A cache hit returns the stored arrays (seen by poisoning the cache contents).
    path = os.path.join(cache, files[0])
    with np.load(path) as z:
        stored = dict(z)
    stored["labels"] = np.array([9, 9, 9, 9, 9])
    np.savez(path, **stored)
    assert load_index(root, "train", cache).labels.tolist() == [9] * 5
    # Adding an image changes the class folder's mtime: the cache is rebuilt.
    _touch_image(f"{root}/train/n03/f.jpg", fmt="JPEG")
    os.utime(f"{root}/train/n03", ns=(1, 1))
    again = load_index(root, "train", cache)
    assert again.labels.tolist() == first.labels.tolist() + [2]


def test_non_ascii_file_names(tmp_path):
    _touch_image(f"{tmp_path}/train/n01/café_1.jpg", fmt="JPEG")
    index = load_index(str(tmp_path), "train", str(tmp_path / "cache"))
    assert index.path(0) == os.path.join(str(tmp_path), "train", "n01", "café_1.jpg")
    assert index.read(0)[:2] == b"\xff\xd8"  # a JPEG's start-of-image marker


def test_scan_memory_per_image_is_small(tmp_path):
    # The scaled version of benchmarks/index.py's 1.28M-file tree: the peak of what
    # the scan allocates per image must stay within the 100 MB / 1.28M images budget
    # (docs/PERFORMANCE.md, "File index"); Python strings per path would take ~130.
    classes, per_class = 20, 500
    for c in range(classes):
        d = tmp_path / "train" / f"n{c:08d}"
        d.mkdir(parents=True)
        for k in range(per_class):
            (d / f"n{c:08d}_{k}.JPEG").touch()
    tracemalloc.start()
    try:
        index = scan_split(str(tmp_path / "train"))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(index) == classes * per_class
    assert index.labels[per_class] == 1 and index.labels[-1] == classes - 1
    assert peak / len(index) < 100e6 / 1.28e6, peak / len(index)
