"""timm's ViT model names as pycls_fast configs: the shipped config of the same
shape plus the overrides that make it timm's model (class-token head, LayerNorm eps
1e-6, image size), so that `--cfg vit_small_patch16_224` and
`timm_cfg("vit_small_patch16_224")` build what timm builds (weights convert with
timm_compat.from_timm; nothing is downloaded).

    cfg = timm_cfg("vit_base_patch16_224", ["MODEL.NUM_CLASSES", "100"])
"""

import os
import re
from collections.abc import Sequence

from yacs.config import CfgNode

from pycls_fast.config import load_cfg

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# timm's name (without the image size) -> the shipped config of its shape.
CONFIGS = {
    "vit_tiny_patch16": "configs/vit/ViT-Ti-16.yaml",
    "vit_small_patch16": "configs/vit/ViT-S-16.yaml",
    "vit_base_patch16": "configs/vit/ViT-B-16.yaml",
    "vit_large_patch16": "configs/vit/ViT-L-16.yaml",
    "vit_huge_patch14": "configs/vit/ViT-H-14.yaml",
    "vit_giant_patch14": "configs/vit/ViT-g-14.yaml",
    "vit_gigantic_patch14": "configs/vit/ViT-G-14.yaml",
}

# What timm's VisionTransformer has that the shipped configs do not.
TIMM_OVERRIDES = ["VIT.CLASSIFIER_TYPE", "token", "LN.EPS", "1e-6"]

_NAME = re.compile(r"^(vit_[a-z]+_patch\d+)_(\d+)(?:\.[\w.]+)?$")


def timm_config(name: str) -> tuple[str, list[str]] | None:
    """(config file, overrides) of a timm ViT name such as `vit_small_patch16_224`
    (a pretrained tag like `.augreg_in21k` is ignored), or None for other names."""
    match = _NAME.match(name)
    if not match or match.group(1) not in CONFIGS:
        return None
    size = match.group(2)
    overrides = [*TIMM_OVERRIDES, "TRAIN.IM_SIZE", size]
    # The evaluation resize keeps pycls's 224 / 256 ratio at other sizes.
    overrides += ["TEST.IM_SIZE", str(round(int(size) * 256 / 224))]
    return os.path.join(ROOT, CONFIGS[match.group(1)]), overrides


def timm_names() -> list[str]:
    """The timm names known here, at 224 px."""
    return [f"{k}_224" for k in CONFIGS]


def timm_cfg(name: str, opts: Sequence[str] = ()) -> CfgNode:
    """The checked config of timm's model `name`, `opts` overriding its keys;
    ValueError for a name that is not one of `timm_names()` (any image size)."""
    found = timm_config(name)
    if found is None:
        raise ValueError(f"not a timm ViT name known here: {name!r} ({timm_names()})")
    path, overrides = found
    return load_cfg(path, overrides + list(opts))
