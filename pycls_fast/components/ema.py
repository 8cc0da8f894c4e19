"""Exponential moving average (EMA) of the model weights, with pycls's semantics."""

import copy
from collections.abc import Mapping

import torch
from torch import nn
from yacs.config import CfgNode

from pycls_fast.runtime.distributed import local_tensor


def create_ema(model: nn.Module) -> nn.Module:
    """Returns a frozen copy of `model` to hold the EMA weights, in fp32 whatever the
    model's dtypes: with alpha ~ 1e-3 an update in bf16 or fp16 rounds away (the
    EMA would not move). Evaluated under autocast like AMP O2 (trainer.test_epoch).
    Made before the model is sharded or wrapped, on the meta device for a model
    built there (a copy of shapes only); it is sharded alike, then `fill_ema`
    gives it the model's values, shard by shard."""
    ema = copy.deepcopy(model).float()
    for p in ema.parameters():
        p.requires_grad_(False)
    return ema


@torch.no_grad()
def fill_ema(ema: nn.Module, model: nn.Module, device: torch.device) -> nn.Module:
    """Allocates `ema` (from `create_ema`, split and sharded like `model`) on
    `device` and copies the model's values into it, each rank its own shards (no
    whole copy on any rank); returns `ema`."""
    ema.to_empty(device=device)
    theirs = model.state_dict()
    for name, e in ema.state_dict().items():
        local_tensor(e).copy_(local_tensor(theirs[name]))
    return ema


def ema_alpha(cfg: CfgNode, epoch: float, batch_size: int | None = None) -> float:
    """pycls's EMA update value, made fairly independent of batch size and length.

    alpha = EMA_ALPHA * batch / MAX_EPOCH * EMA_UPDATE_PERIOD (capped at 1), batch the
    global batch in use (`batch_size`: a TRAIN.SIZE_SCHEDULE stage's; default
    TRAIN.BATCH_SIZE); during warmup the EMA simply copies the weights (alpha = 1).
    """
    batch = cfg.TRAIN.BATCH_SIZE if batch_size is None else batch_size
    adjust = batch / cfg.OPTIM.MAX_EPOCH * cfg.OPTIM.EMA_UPDATE_PERIOD
    alpha = min(1.0, cfg.OPTIM.EMA_ALPHA * adjust)
    return 1.0 if epoch < cfg.OPTIM.WARMUP_EPOCHS else alpha


@torch.no_grad()
def update_ema(
    model: nn.Module,
    ema: nn.Module,
    alpha: float,
    state: Mapping[str, torch.Tensor] | None = None,
) -> None:
    """ema <- (1 - alpha) * ema + alpha * model, over the whole state (buffers too).
    `state`: the model's state to follow in place of model.state_dict(), in its
    order (AMP O2 without FSDP: the fp32 masters, MasterWeights.fp32_state)."""
    # FSDP: both are sharded alike, so each rank updates its own shards.
    ema_tensors = [local_tensor(t) for t in ema.state_dict().values()]
    state = model.state_dict() if state is None else state
    tensors = [local_tensor(t) for t in state.values()]
    floats = [(e, t) for e, t in zip(ema_tensors, tensors) if e.is_floating_point()]
    if floats:
        es, ts = zip(*floats)
        torch._foreach_lerp_(list(es), [t.to(e.dtype) for e, t in floats], alpha)
    for e, t in zip(ema_tensors, tensors):
        if not e.is_floating_point():
            e.copy_(t)


def ema_enabled(cfg: CfgNode) -> bool:
    """Whether the config asks for an EMA model."""
    return cfg.OPTIM.EMA_ALPHA > 0 and cfg.OPTIM.EMA_UPDATE_PERIOD > 0
