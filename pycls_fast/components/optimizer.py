"""Optimizers (multi-tensor apply or per-parameter loop) and learning-rate schedules.

`construct_optimizer(params, cfg)` builds SGD / Adam / AdamW (torch) or LAMB (timm)
with pycls's parameter groups: BN, LN and bias parameters may get their own weight
decay. With OPTIM.MTA the update is one fused multi-tensor-apply kernel over each group
(torch `foreach`, or `fused` where the device supports it); without, a Python loop over
parameters (the baseline).

`lr_at(cfg, epoch_float)` is pycls's schedule, evaluated at a fractional epoch so the
learning rate moves every iteration (OPTIM.LR_PER_ITER; pycls updates once per epoch).
"""

import inspect
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
from yacs.config import CfgNode

from pycls_fast.models.vit import LayerScale

# The ViT's parameters that timm's VisionTransformer.no_weight_decay() names
# ('pos_embed', 'cls_token', 'dist_token') under our names.
NO_DECAY_TOKENS = ("pos_embedding", "class_token", "dist_token")


def layer_id(name: str, num_layers: int) -> int:
    """The depth of a ViT parameter for layer-wise learning-rate decay, as timm's
    `param_groups_layer_decay` assigns it for its VisionTransformer: 0 for the stem,
    class and distillation tokens and position embedding, i + 1 for encoder block i,
    the last block's for the final norm (timm groups `norm` with the blocks),
    num_layers + 1 for the heads."""
    if name.startswith(("stem.", "class_token", "dist_token", "pos_embedding")):
        return 0
    if name.startswith("encoder.block_"):
        return int(name[len("encoder.block_") :].split(".")[0]) + 1
    if name.startswith("encoder.ln."):
        return num_layers
    return num_layers + 1


def param_groups(model: nn.Module, cfg: CfgNode) -> list[dict[str, Any]]:
    """Splits trainable parameters into pycls's weight-decay groups.

    Returns a list of {"params": [...], "weight_decay": wd, "lr_scale": s, "name":
    ...}: BN and LN parameters use BN/LN.CUSTOM_WEIGHT_DECAY when enabled (LayerScale
    gammas count as LN: per-channel scales, undecayed in DeiT III), other biases use
    OPTIM.BIAS_CUSTOM_WEIGHT_DECAY when enabled, the position embedding and the class
    and distillation tokens none with OPTIM.NO_DECAY_TOKENS (timm's no_weight_decay),
    the rest (those included otherwise, as in pycls) OPTIM.WEIGHT_DECAY. With
    OPTIM.LAYER_DECAY d < 1 each group is split by depth (`layer_id`), with
    lr_scale = d ** (num_layers + 1 - depth); `set_lr` applies it.
    """
    wd = cfg.OPTIM.WEIGHT_DECAY
    rules = {
        "bn": (cfg.BN.USE_CUSTOM_WEIGHT_DECAY, cfg.BN.CUSTOM_WEIGHT_DECAY),
        "ln": (cfg.LN.USE_CUSTOM_WEIGHT_DECAY, cfg.LN.CUSTOM_WEIGHT_DECAY),
        "bias": (
            cfg.OPTIM.BIAS_USE_CUSTOM_WEIGHT_DECAY,
            cfg.OPTIM.BIAS_CUSTOM_WEIGHT_DECAY,
        ),
        "token": (cfg.OPTIM.NO_DECAY_TOKENS, 0.0),
    }
    decay = cfg.OPTIM.LAYER_DECAY
    num_layers = cfg.VIT.NUM_LAYERS
    no_decay_tokens = cfg.OPTIM.NO_DECAY_TOKENS
    groups = {}  # (kind, depth) -> params, in the model's order
    for prefix, module in model.named_modules():
        for name, p in module.named_parameters(recurse=False):
            if not p.requires_grad:
                continue
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                kind = "bn"
            elif isinstance(module, (nn.LayerNorm, LayerScale)):
                # DeiT III (timm) decays no 1-D parameter: a LayerScale gamma pulled
                # towards 0 would switch its branch off.
                kind = "ln"
            elif name == "bias":
                kind = "bias"
            elif no_decay_tokens and not prefix and name in NO_DECAY_TOKENS:
                kind = "token"
            else:
                kind = "weights"
            full = f"{prefix}.{name}" if prefix else name
            depth = layer_id(full, num_layers) if decay < 1 else num_layers + 1
            groups.setdefault((kind, depth), []).append(p)
    order = {"bn": 0, "ln": 1, "bias": 2, "token": 3, "weights": 4}
    out = []
    for (kind, depth), params in sorted(
        groups.items(), key=lambda g: (order[g[0][0]], g[0][1])
    ):
        use_custom, custom_wd = rules.get(kind, (False, wd))
        group = {"params": params, "weight_decay": custom_wd if use_custom else wd}
        group["lr_scale"] = decay ** (num_layers + 1 - depth)
        group["name"] = kind if decay >= 1 else f"{kind}_layer{depth}"
        out.append(group)
    return out


def split_by_tensor_kind(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`groups` with each group split into plain tensors and DTensors of each mesh
    and placement (tensor parallelism makes some parameters DTensors): a fused or
    foreach kernel takes one kind per call. Groups of one kind are returned as they
    are."""
    from torch.distributed.tensor import DTensor

    def kind(p):
        if isinstance(p, DTensor):
            return (id(p.device_mesh), tuple(map(str, p.placements)))
        return None

    out = []
    for group in groups:
        kinds: dict = {}
        for p in group["params"]:
            kinds.setdefault(kind(p), []).append(p)
        for params in kinds.values():
            out.append({**group, "params": params})
    return out


def fused_supported(groups: Sequence[dict[str, Any]], cls: type | None = None) -> bool:
    """Whether torch has a fused optimizer kernel for every parameter of `groups`:
    floating point, on a device type torch lists as fused-capable. The same test
    torch applies at the first `step()` (torch/optim/optimizer.py,
    `_device_dtype_check_for_fused`), made here at construction. For DTensor
    parameters (FSDP2 shards, tensor parallelism) the fused kernel of `cls` must also
    have a DTensor sharding rule: torch registers AdamW's and Adam's, not SGD's
    (`aten._fused_sgd_` raises NotImplementedError at the first step)."""
    from torch.distributed.tensor import DTensor

    devices = _get_fused_kernels_supported_devices()
    params = [p for group in groups for p in group["params"]]
    if any(isinstance(p, DTensor) for p in params) and not _dtensor_fused(cls):
        return False
    return all(p.device.type in devices and torch.is_floating_point(p) for p in params)


def _dtensor_fused(cls: type | None) -> bool:
    """Whether DTensor has a sharding rule for the in-place fused kernel of optimizer
    class `cls` (None: any optimizer torch has a fused kernel for)."""
    from torch.distributed.tensor import DTensor

    names = {torch.optim.SGD: "_fused_sgd_", torch.optim.Adam: "_fused_adam_"}
    names[torch.optim.AdamW] = "_fused_adamw_"
    if cls is None:
        return all(_dtensor_fused(c) for c in names)
    op = getattr(torch.ops.aten, names[cls]).default
    propagator = DTensor._op_dispatcher.sharding_propagator
    tables = ("op_strategy_funcs", "op_single_dim_strategy_funcs", "op_to_rules")
    return any(op in getattr(propagator, table, {}) for table in tables)


def _multi_tensor_kwargs(mta, groups, cls):
    """foreach/fused flags: the fused kernel (one pass over all tensors of a group, on
    CUDA and on CPU) when MTA is on and torch has one for these parameters, else the
    multi-tensor `foreach` path; a Python loop over parameters when MTA is off.

    On a CPU, torch's `foreach` path is no faster than the loop while `fused` is
    several times faster (benchmarks/optimizer.py; figures in docs/PERFORMANCE.md).
    """
    if not mta:
        return {"foreach": False}
    return {"fused": True} if fused_supported(groups, cls) else {"foreach": True}


def construct_optimizer(
    groups: Sequence[dict[str, Any]], cfg: CfgNode
) -> torch.optim.Optimizer:
    """Returns the OPTIM.OPTIMIZER optimizer over `groups` (from `param_groups`)."""
    o = cfg.OPTIM
    name = o.OPTIMIZER
    if name == "sgd":
        cls = torch.optim.SGD
        kwargs = {
            "momentum": o.MOMENTUM,
            "dampening": o.DAMPENING,
            "nesterov": o.NESTEROV,
        }
    elif name in ("adam", "adamw"):
        cls = torch.optim.Adam if name == "adam" else torch.optim.AdamW
        kwargs = {"betas": (o.BETA1, o.BETA2)}
    else:
        return _timm_optimizer(groups, cfg)
    flags = _multi_tensor_kwargs(o.MTA, groups, cls)
    return cls(groups, lr=o.BASE_LR, **kwargs, **flags)


def _timm_optimizer(groups, cfg):
    """OPTIM.OPTIMIZER through timm's optimizer factory over our parameter groups
    (their weight decay and lr_scale kept): OPTIM.MOMENTUM where the optimizer has
    momentum, (OPTIM.BETA1, OPTIM.BETA2) where it takes two betas, timm's defaults
    otherwise. Most update parameter by parameter; OPTIM.MTA asks for `foreach` where
    the optimizer offers it."""
    from timm.optim import create_optimizer_v2, get_optimizer_info

    o = cfg.OPTIM
    info = get_optimizer_info(o.OPTIMIZER)
    kwargs = {}
    if info.has_betas and info.num_betas == 2:
        kwargs["betas"] = (o.BETA1, o.BETA2)
    if "foreach" in inspect.signature(info.opt_class).parameters:
        kwargs["foreach"] = o.MTA
    return create_optimizer_v2(
        [dict(g) for g in groups],
        opt=o.OPTIMIZER,
        lr=o.BASE_LR,
        momentum=o.MOMENTUM,
        **kwargs,
    )


def _lr_policy(o, epoch):
    """pycls's lr policies at a (fractional) epoch, before warmup."""
    if o.LR_POLICY == "cos":
        # Cosine from BASE_LR down to MIN_LR * BASE_LR over MAX_EPOCH.
        lr = 0.5 * (1.0 + math.cos(math.pi * epoch / o.MAX_EPOCH))
        return o.BASE_LR * ((1.0 - o.MIN_LR) * lr + o.MIN_LR)
    if o.LR_POLICY == "exp":
        # Exponential from BASE_LR to MIN_LR * BASE_LR over MAX_EPOCH.
        return o.BASE_LR * math.pow(o.MIN_LR, epoch / o.MAX_EPOCH)
    if o.LR_POLICY == "lin":
        lr = 1.0 - epoch / o.MAX_EPOCH
        return o.BASE_LR * ((1.0 - o.MIN_LR) * lr + o.MIN_LR)
    if o.LR_POLICY == "steps":
        index = sum(1 for s in o.STEPS if s <= epoch) - 1
        return o.BASE_LR * o.LR_MULT**index
    raise ValueError(f"unknown OPTIM.LR_POLICY {o.LR_POLICY!r}")


def lr_at(cfg: CfgNode, epoch: float) -> float:
    """Learning rate at `epoch` (float: epoch + iter / iters_per_epoch), with warmup.

    Warmup goes linearly from WARMUP_FACTOR to 1 over WARMUP_EPOCHS (pycls). With
    OPTIM.LR_PER_ITER False the epoch is floored: pycls's once-per-epoch update.
    """
    o = cfg.OPTIM
    if not o.LR_PER_ITER:
        epoch = math.floor(epoch)
    lr = _lr_policy(o, epoch)
    if epoch < o.WARMUP_EPOCHS:
        alpha = epoch / o.WARMUP_EPOCHS
        lr *= o.WARMUP_FACTOR * (1.0 - alpha) + alpha
    return lr


def schedule_warnings(cfg: CfgNode) -> list[str]:
    """What in the lr schedule of `cfg` is most likely a mistake, in words: a warmup
    as long as the run (the lr never reaches OPTIM.BASE_LR)."""
    o = cfg.OPTIM
    if 0 < o.MAX_EPOCH <= o.WARMUP_EPOCHS:
        peak = max(lr_at(cfg, o.MAX_EPOCH * i / 100) for i in range(100))
        return [
            f"OPTIM.WARMUP_EPOCHS ({o.WARMUP_EPOCHS:g}) >= OPTIM.MAX_EPOCH "
            f"({o.MAX_EPOCH}): the run ends before the warmup does; the lr peaks at "
            f"{peak:.3g}, never reaching OPTIM.BASE_LR {o.BASE_LR:g}"
        ]
    return []


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Sets the learning rate of every parameter group: `lr` times the group's
    lr_scale (layer-wise decay; 1 without)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
