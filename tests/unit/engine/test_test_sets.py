"""engine/test_sets.py: which test splits are some of the model's classes, and the
logit columns of their classes (timm's lists for ImageNet-A and -R)."""

import os

import pytest

from pycls_fast.engine.test_sets import split_classes, timm_class_list
from pycls_fast.errors import UserError
from tests.helpers import tiny_cfg


def _folders(root, split, names):
    for name in names:
        os.makedirs(os.path.join(root, split, name), exist_ok=True)


def test_subset_of_the_train_classes(tmp_path):
    root = str(tmp_path)
    _folders(root, "train", [f"n{i:08d}" for i in range(10)])
    _folders(root, "part", ["n00000005", "n00000002"])
    _folders(root, "val", [f"n{i:08d}" for i in range(10)])
    _folders(root, "v2", [str(i) for i in range(10)])
    _folders(root, "odd", ["n00000002", "n00000077"])
    cfg = tiny_cfg("DATA.PATH", root)
    part = split_classes(cfg, "part")
    assert (part.count, part.columns, part.name) == (2, [2, 5], "")  # folder order
    assert split_classes(cfg, "val").columns is None
    assert split_classes(cfg, "v2").columns is None  # label numbers: all classes
    with pytest.raises(UserError, match="n00000077"):
        split_classes(cfg, "odd")


def test_imagenet_a_and_r_by_timm_lists(tmp_path):
    root = str(tmp_path)
    a, r = timm_class_list("imagenet_a_synsets"), timm_class_list("imagenet_r_synsets")
    _folders(root, "imagenet-a", a)
    _folders(root, "imagenet-r", r)
    # No train split: a 1000-class model's classes are ImageNet-1k's, in label order.
    cfg = tiny_cfg("DATA.PATH", root, "MODEL.NUM_CLASSES", "1000")
    for split, key, name in (("imagenet-a", "imagenet_a", "ImageNet-A"),
                             ("imagenet-r", "imagenet_r", "ImageNet-R")):  # fmt: skip
        classes = split_classes(cfg, split)
        indices = [int(i) for i in timm_class_list(f"{key}_indices")]
        assert (classes.count, classes.columns, classes.name) == (200, indices, name)
    # A 10-class model without a train split: its class names are unknown.
    assert split_classes(tiny_cfg("DATA.PATH", root), "imagenet-a").columns is None


def test_imagenet_a_against_classes_in_another_order(tmp_path):
    """A train split of A's synsets and a few more: A falls on other logits than
    timm's indices, which is refused rather than read through the wrong columns."""
    root = str(tmp_path)
    a = timm_class_list("imagenet_a_synsets")
    _folders(root, "train", [*a, "n00000001"])
    _folders(root, "imagenet-a", a)
    cfg = tiny_cfg("DATA.PATH", root, "MODEL.NUM_CLASSES", "201")
    with pytest.raises(UserError, match="imagenet_a_indices"):
        split_classes(cfg, "imagenet-a")
