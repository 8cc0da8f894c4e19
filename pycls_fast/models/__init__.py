"""Model builders: `build_model(cfg)` and `complexity(cfg)`."""

from torch import nn
from yacs.config import CfgNode

from pycls_fast.models.vit import ViT, ViTParams


def build_model(cfg: CfgNode) -> nn.Module:
    """Returns the model described by a checked config: an nn.Module on CPU, fp32."""
    return ViT(ViTParams.from_cfg(cfg))


def complexity(cfg: CfgNode) -> dict[str, int]:
    """Returns {"params", "flops", "acts"} of the model (pycls conventions: flops are
    multiply-adds, acts are output elements of each layer) for one image."""
    return ViT.complexity(ViTParams.from_cfg(cfg))


__all__ = ["ViT", "ViTParams", "build_model", "complexity"]
