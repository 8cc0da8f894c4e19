"""Safetensors with timm's parameter names and timm's own config.json, written by
timm's `save_for_hf` into a folder that timm loads with no network:

    model = timm.create_model("local-dir:DST", pretrained=True)

or, naming the architecture and its arguments (config.json's `architecture` and
`model_args`) and the weights file:

    timm.create_model(ARCH, pretrained=True, **MODEL_ARGS,
                      pretrained_cfg_overlay=dict(file="DST/model.safetensors",
                                                  num_classes=N))

The weights are converted by models/timm_compat.py (to_timm) into timm's
VisionTransformer of the config's shape, loaded strictly, and saved from it; the
config records the preprocessing of the test transform (resize by the crop ratio,
bilinear, center crop, ImageNet mean and std).
"""

import json
import os
import shutil
import tempfile

import torch
from torch import nn
from yacs.config import CfgNode

from pycls_fast.datasets.to_device.transform import MEAN, STD
from pycls_fast.errors import ConfigError
from pycls_fast.models.timm_compat import to_timm
from pycls_fast.models.vit import ViTParams

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
# timm's VisionTransformer normalizes with LayerNorm(eps=1e-6); config.json cannot
# carry another eps (norm_layer is a class, not a value).
TIMM_LN_EPS = 1e-6
# timm's names for the standard widths (embed_dim, depth, num_heads).
_SIZES = {
    (192, 12, 3): "tiny",
    (384, 12, 6): "small",
    (768, 12, 12): "base",
    (1024, 24, 16): "large",
    (1280, 32, 16): "huge",
}


def timm_model_args(cfg: CfgNode) -> tuple[str, dict]:
    """(timm architecture name, create_model keyword arguments) that build timm's
    VisionTransformer computing the same function as the config's model;
    ConfigError for what timm's VisionTransformer has no argument for."""
    p = ViTParams.from_cfg(cfg)
    if p.stem_type != "patchify":
        raise ConfigError("VIT.STEM_TYPE: timm's VisionTransformer has no conv stem")
    if cfg.VIT.DISTILL_TOKEN:
        raise ConfigError(
            "VIT.DISTILL_TOKEN: a distilled model is not a timm VisionTransformer"
        )
    if abs(p.ln_eps - TIMM_LN_EPS) > 1e-12:
        raise ConfigError(
            f"LN.EPS is {p.ln_eps:g}: timm's VisionTransformer uses {TIMM_LN_EPS:g} "
            "(train with LN.EPS 1e-6 to export to timm)"
        )
    pooled = p.cls_type == "pooled"
    args = {
        "img_size": p.image_size,
        "patch_size": p.patch_size,
        "embed_dim": p.hidden_d,
        "depth": p.n_layers,
        "num_heads": p.n_heads,
        "mlp_ratio": p.mlp_d / p.hidden_d,
        "num_classes": p.num_classes,
        "global_pool": "avg" if pooled else "token",
        "class_token": not pooled,
        "fc_norm": False,
    }
    if p.layer_scale:
        args["init_values"] = p.layer_scale
    if p.qk_norm:
        args["qk_norm"] = True
    size = _SIZES.get((p.hidden_d, p.n_layers, p.n_heads), "base")
    return f"vit_{size}_patch16_224", args


def data_config(cfg: CfgNode) -> dict:
    """timm's preprocessing of the config's test transform."""
    size = cfg.TRAIN.IM_SIZE
    return {
        "input_size": (3, size, size),
        "interpolation": "bilinear",
        "crop_pct": size / cfg.TEST.IM_SIZE,
        "crop_mode": "center",
        "mean": tuple(MEAN),
        "std": tuple(STD),
    }


def build_timm_model(state: dict, cfg: CfgNode) -> nn.Module:
    """timm's VisionTransformer for `cfg` holding our `state` (strictly loaded)."""
    import timm

    arch, args = timm_model_args(cfg)
    model = timm.create_model(arch, pretrained=False, **args)
    model.load_state_dict(to_timm(state, cfg), strict=True)
    return model.eval()


def export_timm(
    model: nn.Module, cfg: CfgNode, dst: str, stem: str | None = None
) -> dict:
    """Writes DST/model.safetensors and DST/config.json for our `model` (with `stem`:
    DST/<stem>.safetensors and DST/<stem>.json); returns the config written."""
    from timm.models import save_for_hf

    arch, args = timm_model_args(cfg)
    state = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    timm_model = build_timm_model(state, cfg)
    os.makedirs(dst, exist_ok=True)
    # save_for_hf writes a folder's two files; named ones are moved out of it.
    folder = dst if stem is None else tempfile.mkdtemp(dir=dst, prefix=".export")
    save_for_hf(
        timm_model,
        folder,
        model_args=args,
        safe_serialization=True,
        data_config=data_config(cfg),
    )
    path = os.path.join(folder, CONFIG_FILE)
    with open(path) as f:
        config = json.load(f)
    # What save_for_hf copied from the architecture's own pretrained weights (their
    # tag and license) does not describe these.
    pretrained = config.setdefault("pretrained_cfg", {})
    pretrained.pop("license", None)
    pretrained["tag"] = "pycls_fast"
    with open(path, "w") as f:
        json.dump(config, f, indent=2)
    if stem is not None:
        weights, named = export_files(stem)
        os.replace(os.path.join(folder, WEIGHTS_FILE), os.path.join(dst, weights))
        os.replace(path, os.path.join(dst, named))
        shutil.rmtree(folder)
    return config


def export_files(stem: str | None) -> tuple[str, str]:
    """(weights file, config file) names of an export: a folder's model.safetensors
    and config.json, or <stem>.safetensors and <stem>.json."""
    if stem is None:
        return WEIGHTS_FILE, CONFIG_FILE
    return f"{stem}.safetensors", f"{stem}.json"


def load_timm(dst: str, stem: str | None = None) -> nn.Module:
    """timm's model from an export, offline: a folder through timm's `local-dir:`
    source; named files (`stem`) through their config's architecture and model
    arguments, the weights file given as `pretrained_cfg_overlay`'s file."""
    import timm

    if stem is None:
        model = timm.create_model(f"local-dir:{os.path.abspath(dst)}", pretrained=True)
        return model.eval()
    weights, named = export_files(stem)
    with open(os.path.join(dst, named)) as f:
        config = json.load(f)
    overlay = {
        "file": os.path.abspath(os.path.join(dst, weights)),
        "num_classes": config["num_classes"],
    }
    model = timm.create_model(
        config["architecture"],
        pretrained=True,
        pretrained_cfg_overlay=overlay,
        **config["model_args"],
    )
    return model.eval()


@torch.no_grad()
def logit_difference(
    ours: nn.Module, theirs: nn.Module, images: torch.Tensor
) -> tuple[float, float]:
    """(largest |ours(images) - theirs(images)|, largest |ours(images)|) over the
    logits, in float64."""
    a, b = ours(images).double(), theirs(images).double()
    return (a - b).abs().max().item(), a.abs().max().item()
