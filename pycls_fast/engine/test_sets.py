"""Test sets whose classes are some of the model's: ImageNet-A and ImageNet-R hold 200
of ImageNet-1k's classes, so their accuracy is read from the 1000-class logits masked
to those 200 (the logits of the other classes are dropped), as their authors and
timm's validate.py (`--valid-labels`) do.

A test split is a subset when its class folders are some, not all, of the model's
classes: the train split's folders when DATA.PATH has one, else ImageNet-1k's synsets
in label order (timm's `imagenet_synsets.txt`) for a 1000-class model. The subsets that
timm ships lists for (`timm/data/_info/imagenet_{a,r}_{synsets,indices}.txt`) are
named, and their columns checked against timm's indices. A split with all the model's
classes (ImageNet-Sketch, ImageNet-V2) is read as it is.
"""

import os
from dataclasses import dataclass
from importlib import resources

from yacs.config import CfgNode

from pycls_fast.datasets.formats.index import check_split
from pycls_fast.errors import UserError

# timm's class lists of the subsets it knows, and the names they are reported under.
KNOWN_SUBSETS = {"imagenet_a": "ImageNet-A", "imagenet_r": "ImageNet-R"}
IMAGENET_CLASSES = 1000


def timm_class_list(name: str) -> list[str]:
    """The lines of `timm/data/_info/<name>.txt` (synsets or label indices), read
    from the installed timm package."""
    path = resources.files("timm.data") / "_info" / f"{name}.txt"
    return [line.strip() for line in path.read_text().splitlines() if line.strip()]


@dataclass(frozen=True)
class SplitClasses:
    """How a test split's labels relate to the model's logits.

    `columns`: for a subset, the logit column of each of the split's classes (its
    labels 0..n-1 in folder order); None when the split has all the model's classes.
    `name`: the subset's name when timm knows it ("ImageNet-A"), else "".
    """

    count: int
    columns: list[int] | None = None
    name: str = ""


def model_classes(cfg: CfgNode) -> list[str] | None:
    """The class names of the model's logits, in order: the train split's class
    folders when DATA.PATH has one, ImageNet-1k's synsets for a 1000-class model,
    else None (unknown)."""
    train_dir = os.path.join(cfg.DATA.PATH, cfg.TRAIN.SPLIT)
    if cfg.DATA.FORMAT == "folder" and os.path.isdir(train_dir):
        return check_split(cfg.DATA.PATH, cfg.TRAIN.SPLIT)
    if cfg.MODEL.NUM_CLASSES == IMAGENET_CLASSES:
        return timm_class_list("imagenet_synsets")
    return None


def split_classes(cfg: CfgNode, split: str) -> SplitClasses:
    """How the class folders of DATA.PATH/`split` map to the model's logits (see
    SplitClasses); UserError when the split's folders are neither the model's classes
    nor some of them."""
    if cfg.DATA.FORMAT != "folder":
        return SplitClasses(cfg.MODEL.NUM_CLASSES)  # shards: written with train's
    folders = check_split(cfg.DATA.PATH, split)
    reference = model_classes(cfg)
    by_number = folders == [str(i) for i in range(len(folders))]  # ImageNet-V2
    if reference is None or folders == reference or by_number:
        return SplitClasses(len(folders))
    where = {name: i for i, name in enumerate(reference)}
    unknown = [f for f in folders if f not in where]
    if unknown:
        raise UserError(
            f"class folder {unknown[0]} of {os.path.join(cfg.DATA.PATH, split)} is "
            f"not one of the model's {len(reference)} classes ({len(unknown)} such)"
        )
    columns = [where[f] for f in folders]
    return SplitClasses(len(folders), columns, _known_subset(folders, columns))


def _known_subset(folders: list[str], columns: list[int]) -> str:
    """The name of the subset timm ships these synsets for, or ""; UserError when
    the columns differ from timm's (the model's classes are not ImageNet's order)."""
    for key, name in KNOWN_SUBSETS.items():
        if folders != timm_class_list(f"{key}_synsets"):
            continue
        expected = [int(i) for i in timm_class_list(f"{key}_indices")]
        if columns != expected:
            raise UserError(
                f"{name}: the model's classes are not ImageNet-1k's in label order "
                f"(its synsets fall on other logits than timm's {key}_indices.txt)"
            )
        return name
    return ""
