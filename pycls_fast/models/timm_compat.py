"""Weight conversion between timm's `VisionTransformer` and pycls_fast's ViT.

Supported timm models (patchify stem, no register tokens; LayerScale as
`blocks.N.ls1.gamma` / `ls2.gamma` when VIT.LAYER_SCALE > 0, timm's `init_values`):
- token classifier: `class_token=True, global_pool='token'`;
- pooled classifier: `class_token=False, global_pool='avg', fc_norm=False` (the final
  norm comes before the mean, as in pycls).
Set LN.EPS to timm's 1e-6 for the converted model to compute the same function.

The conversion happens at the boundary, on state dicts; the model knows nothing of it.
"""

import functools
import itertools
import re
from typing import Any

import torch
from torch import nn
from yacs.config import CfgNode

from pycls_fast.errors import ConfigError
from pycls_fast.models.pycls_compat import from_pycls_main, is_pycls_main
from pycls_fast.models.vit import ViTParams

# (timm suffix, ours suffix) for each encoder block
_BLOCK_KEYS = [
    ("norm1", "ln_1"),
    ("attn.qkv", "self_attention.attn_proj"),
    ("attn.proj", "self_attention.out_proj"),
    ("norm2", "ln_2"),
    ("mlp.fc1", "mlp_block.linear_1"),
    ("mlp.fc2", "mlp_block.linear_2"),
]

_TOP_KEYS = [
    ("patch_embed.proj", "stem.patchify"),
    ("norm", "encoder.ln"),
    ("head", "head.head_fc"),
]


def _key_map(n_layers, class_token, layer_scale=False, qk_norm=False):
    """Returns [(timm key, our key)] for every tensor of the model."""
    pairs = [("pos_embed", "pos_embedding")]
    if qk_norm:
        for i, t, w in itertools.product(
            range(n_layers), ("q", "k"), ("weight", "bias")
        ):
            ours = f"encoder.block_{i}.self_attention.{t}_norm.{w}"
            pairs.append((f"blocks.{i}.attn.{t}_norm.{w}", ours))
    if layer_scale:
        for i in range(n_layers):
            for t, o in (("ls1", "ls_1"), ("ls2", "ls_2")):
                pairs.append((f"blocks.{i}.{t}.gamma", f"encoder.block_{i}.{o}.gamma"))
    if class_token:
        pairs.append(("cls_token", "class_token"))
    for t, o in _TOP_KEYS:
        pairs += [(f"{t}.weight", f"{o}.weight"), (f"{t}.bias", f"{o}.bias")]
    for i in range(n_layers):
        for t, o in _BLOCK_KEYS:
            for w in ("weight", "bias"):
                pairs.append((f"blocks.{i}.{t}.{w}", f"encoder.block_{i}.{o}.{w}"))
    return pairs


def unwrap_state_dict(obj: Any) -> Any:
    """Returns the state dict inside a checkpoint object (timm, pycls or plain);
    pycls main's ViT names and shapes become pycls_fast's."""
    for key in ("model_state", "state_dict", "model", "state_dict_ema"):
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
            break
    if isinstance(obj, dict) and is_pycls_main(obj):
        return from_pycls_main(obj)
    return obj


def _check_supported(p):
    if p.stem_type != "patchify":
        raise ConfigError(
            "VIT.STEM_TYPE: timm's VisionTransformer has no conv stem; use 'patchify'"
        )


def _resample_pos_embed(pos, p, num_prefix):
    """Interpolates timm position embeddings to this config's grid (bicubic, timm)."""
    from timm.layers import resample_abs_pos_embed

    grid = p.image_size // p.patch_size
    return resample_abs_pos_embed(pos, [grid, grid], num_prefix_tokens=num_prefix)


def from_timm(
    state_dict: dict[str, Any], cfg: CfgNode, *, drop_head: bool = False
) -> dict[str, torch.Tensor]:
    """Converts a timm ViT state dict to ours for `cfg`.

    Position embeddings of another image size are resampled to TRAIN.IM_SIZE; with
    `drop_head`, the classifier is left out (to fine-tune on other classes). Raises
    ConfigError when the checkpoint does not fit the config.
    """
    p = ViTParams.from_cfg(cfg)
    _check_supported(p)
    sd = unwrap_state_dict(state_dict)
    has_token = "cls_token" in sd
    if has_token != (p.cls_type == "token"):
        want = "token" if has_token else "pooled"
        raise ConfigError(
            f"VIT.CLASSIFIER_TYPE is '{p.cls_type}' but the timm checkpoint is a "
            f"'{want}' model"
        )
    if any(k.startswith("fc_norm.") for k in sd):
        raise ConfigError(
            "timm checkpoint has fc_norm (norm after pooling); pycls_fast's pooled "
            "classifier normalizes before pooling (timm fc_norm=False)"
        )
    blocks = {int(m.group(1)) for k in sd if (m := re.match(r"blocks\.(\d+)\.", k))}
    if len(blocks) != p.n_layers:
        raise ConfigError(
            f"VIT.NUM_LAYERS is {p.n_layers} but the timm checkpoint has "
            f"{len(blocks)} blocks"
        )
    has_ls = any(re.match(r"blocks\.\d+\.ls1\.gamma$", k) for k in sd)
    if has_ls != (p.layer_scale > 0):
        raise ConfigError(
            "VIT.LAYER_SCALE: the timm checkpoint "
            + ("has LayerScale (set VIT.LAYER_SCALE > 0)" if has_ls else "has none")
        )
    has_qk_norm = any(re.match(r"blocks\.\d+\.attn\.q_norm\.weight$", k) for k in sd)
    if has_qk_norm != p.qk_norm:
        raise ConfigError(
            "VIT.QK_NORM: the timm checkpoint "
            + ("has qk_norm (set VIT.QK_NORM True)" if has_qk_norm else "has none")
        )
    pairs = _key_map(p.n_layers, has_token, has_ls, has_qk_norm)
    missing = [t for t, _ in pairs if t not in sd]
    if missing:
        raise ConfigError(
            f"timm checkpoint lacks {missing[0]} (and {len(missing) - 1} more)"
        )
    extra = sorted(set(sd) - {t for t, _ in pairs})
    if extra:
        raise ConfigError(f"timm checkpoint has unsupported tensor {extra[0]}")
    out = {o: sd[t] for t, o in pairs}
    if out["pos_embedding"].shape[1] != p.seq_len:
        out["pos_embedding"] = _resample_pos_embed(
            out["pos_embedding"], p, 1 if has_token else 0
        )
    if drop_head:
        del out["head.head_fc.weight"], out["head.head_fc.bias"]
    _check_shapes(out, p)
    return out


def to_timm(state_dict: dict[str, Any], cfg: CfgNode) -> dict[str, torch.Tensor]:
    """Converts our ViT state dict for `cfg` to timm's VisionTransformer names."""
    p = ViTParams.from_cfg(cfg)
    _check_supported(p)
    sd = unwrap_state_dict(state_dict)
    pairs = _key_map(p.n_layers, p.cls_type == "token", p.layer_scale > 0, p.qk_norm)
    missing = [o for _, o in pairs if o not in sd]
    if missing:
        raise ConfigError(
            f"checkpoint lacks {missing[0]} (and {len(missing) - 1} more)"
        )
    return {t: sd[o] for t, o in pairs}


def _check_shapes(sd, p):
    expected = {
        "pos_embedding": (1, p.seq_len, p.hidden_d),
        "stem.patchify.weight": (p.hidden_d, 3, p.patch_size, p.patch_size),
        "encoder.block_0.mlp_block.linear_1.weight": (p.mlp_d, p.hidden_d),
        "head.head_fc.weight": (p.num_classes, p.hidden_d),
    }
    names = {
        "pos_embedding": "TRAIN.IM_SIZE / VIT.HIDDEN_DIM",
        "stem.patchify.weight": "VIT.HIDDEN_DIM / VIT.PATCH_SIZE",
        "encoder.block_0.mlp_block.linear_1.weight": "VIT.MLP_DIM / VIT.HIDDEN_DIM",
        "head.head_fc.weight": "MODEL.NUM_CLASSES (or drop the head)",
    }
    for key, shape in expected.items():
        if key in sd and tuple(sd[key].shape) != shape:
            got = tuple(sd[key].shape)
            raise ConfigError(
                f"{names[key]}: checkpoint tensor {key} has shape {got}, the config "
                f"expects {shape}"
            )


def build_timm_vit(cfg: CfgNode, **kwargs: Any) -> nn.Module:
    """Builds timm's VisionTransformer with this config's dimensions (random init).

    Used for interop tests and as the peer in benchmarks; nothing is downloaded.
    """
    from timm.models.vision_transformer import VisionTransformer

    p = ViTParams.from_cfg(cfg)
    _check_supported(p)
    pooled = p.cls_type == "pooled"
    return VisionTransformer(
        img_size=p.image_size,
        patch_size=p.patch_size,
        num_classes=p.num_classes,
        global_pool="avg" if pooled else "token",
        class_token=not pooled,
        fc_norm=False,
        embed_dim=p.hidden_d,
        depth=p.n_layers,
        num_heads=p.n_heads,
        mlp_ratio=p.mlp_d / p.hidden_d,
        norm_layer=functools.partial(torch.nn.LayerNorm, eps=p.ln_eps),
        init_values=p.layer_scale or None,
        qk_norm=p.qk_norm,
        **kwargs,
    )
