"""Synthetic photo-like JPEG folders."""

import os

import numpy as np
from PIL import Image

from pycls_fast.datasets.formats.synthetic import make_image_folder


def test_layout_sizes_and_determinism(tmp_path):
    a = make_image_folder(
        str(tmp_path / "a"), num_classes=2, images_per_class=3, size=(40, 30)
    )
    b = make_image_folder(
        str(tmp_path / "b"), num_classes=2, images_per_class=3, size=(40, 30)
    )
    for split in ("train", "val"):
        assert sorted(os.listdir(os.path.join(a, split))) == ["n00000000", "n00000001"]
    files = sorted(os.listdir(os.path.join(a, "train", "n00000001")))
    assert files == [f"train_0001_{i:06d}.JPEG" for i in range(3)]
    path = os.path.join("train", "n00000001", files[0])
    with Image.open(os.path.join(a, path)) as im:
        assert im.size == (40, 30) and im.mode == "RGB" and im.format == "JPEG"
    with open(os.path.join(a, path), "rb") as f, open(os.path.join(b, path), "rb") as g:
        assert f.read() == g.read()


def test_imagenet_like_file_size_and_texture(tmp_path):
    root = make_image_folder(
        str(tmp_path), splits=("train",), num_classes=1, images_per_class=4
    )
    folder = os.path.join(root, "train", "n00000000")
    sizes = [os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder)]
    assert all(15_000 < s < 150_000 for s in sizes)
    with Image.open(os.path.join(folder, sorted(os.listdir(folder))[0])) as im:
        arr = np.asarray(im).astype(float)
    assert im.size == (500, 375)
    assert arr.std() > 20  # photo-like content, not a flat fill
