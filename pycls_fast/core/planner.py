"""Per-rank memory of a training layout, and the layout a run should use.

    mem = per_rank_memory(cfg, world=8, fsdp=True, checkpoint=False)  # bytes by part
    best, rows = plan(cfg, num_gpus=64, gpu_gib=80)                  # tools/plan_net.py

The parts, as pycls_fast lays them out (exact per tensor, from the model built on the
meta device, so a 22B model costs nothing to plan):
- params, grads, optimizer state, fp32 master copies (AMP O2 without FSDP), the fp32
  EMA: whole on every rank under DDP, one dim-0 chunk of each tensor per rank under
  FSDP (the largest chunk, rank 0's);
- under FSDP, the weights gathered for computing (the block running and the one
  prefetched, in the compute dtype) and one block's unsharded gradients before their
  reduce-scatter;
- activations kept for backward, per block and image, by Korthikanti et al. ("Reducing
  Activation Recomputation in Large Transformer Models", 2022, eq. 2): s*h*(34 +
  5*a*s/h) bytes in 16-bit (twice in fp32); with activation checkpointing, each block
  keeps only its input (2*s*h bytes) and one block's activations live at a time.
Layouts compared: DDP, FSDP, FSDP with activation checkpointing (tensor and pipeline
parallelism are not built yet). The fastest that fits is chosen: DDP before FSDP
(FSDP gathers each block's weights in forward and backward), and activation
checkpointing last (it recomputes the forward: ~4/3 of the step's compute).
"""

import math
from dataclasses import dataclass

import torch
from torch import nn
from yacs.config import CfgNode

from pycls_fast.core.precision import AmpMode, resolve_amp
from pycls_fast.models import build_model

GIB = 2**30
HEADROOM = 0.9  # of a GPU's memory: the allocator's fragmentation, CUDA context
# Relative step throughput of each layout (compute only; communication not modelled).
SPEED = {"ddp": 1.0, "fsdp": 1.0, "fsdp+ac": 0.75}


def _param_tensors(cfg):
    """(shape, whether it sits in a LayerNorm) of each trainable parameter."""
    with torch.device("meta"):
        model = build_model(cfg)
    out = []
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if p.requires_grad:
                out.append((tuple(p.shape), isinstance(module, nn.LayerNorm)))
    return out


def _local_numel(shape, world, fsdp):
    if not fsdp or not shape:
        return math.prod(shape)
    return math.ceil(shape[0] / world) * math.prod(shape[1:])


def activation_bytes(cfg: CfgNode, images: int, checkpoint: bool) -> int:
    """Bytes of activations kept for backward by `images` images (see the module
    docstring), in the precision of the AMP mode."""
    s = (cfg.TRAIN.IM_SIZE // cfg.VIT.PATCH_SIZE) ** 2 + 1
    h, a, n = cfg.VIT.HIDDEN_DIM, cfg.VIT.NUM_HEADS, cfg.VIT.NUM_LAYERS
    mode, _ = resolve_amp(cfg)
    scale = 2.0 if mode is AmpMode.FP32 else 1.0
    per_block = s * h * (34 + 5 * a * s / h) * scale
    # Checkpointed: each block's input, and one block recomputed at a time.
    per_image = n * 2 * s * h * scale + per_block if checkpoint else n * per_block
    return int(per_image * images)


def per_rank_memory(
    cfg: CfgNode, world: int, fsdp: bool, checkpoint: bool = False
) -> dict[str, int]:
    """Bytes per rank by part (params, grads, optimizer, master, ema, gathered,
    activations, total) of training `cfg` on `world` ranks, with or without FSDP."""
    mode, half = resolve_amp(cfg)
    half_b = torch.finfo(half).bits // 8
    ln_fp32 = cfg.AMP.LAYER_NORM_FP32
    opt = cfg.OPTIM.OPTIMIZER
    states = 2 if opt in ("adam", "adamw", "lamb") else int(cfg.OPTIM.MOMENTUM > 0)
    out = dict.fromkeys(("params", "grads", "optimizer", "master", "ema"), 0)
    tensors = _param_tensors(cfg)
    for shape, is_ln in tensors:
        n = _local_numel(shape, world, fsdp)
        if mode is AmpMode.O3 or (
            mode is AmpMode.O2 and not fsdp and not (is_ln and ln_fp32)
        ):
            stored = half_b
        else:
            stored = 4
        out["params"] += n * stored
        # O2 without FSDP: the half grads move to the fp32 masters before the step.
        master = mode is AmpMode.O2 and not fsdp and stored != 4
        out["master"] += n * 4 if master else 0
        opt_b = 4 if master else stored
        out["grads"] += n * opt_b
        out["optimizer"] += states * n * opt_b
        out["ema"] += n * 4 if cfg.OPTIM.EMA_ALPHA > 0 else 0
    out["gathered"] = 0
    if fsdp:
        block = sum(math.prod(shape) for shape, _ in tensors) / cfg.VIT.NUM_LAYERS
        compute_b = half_b if mode in (AmpMode.O2, AmpMode.O3) else 4
        out["gathered"] = int(block * (2 * compute_b + 4))
    images = cfg.TRAIN.BATCH_SIZE // world // cfg.TRAIN.ACCUM_STEPS
    out["activations"] = activation_bytes(cfg, images, checkpoint)
    out["total"] = sum(out.values())
    return out


@dataclass
class Row:
    """One candidate layout and its predicted per-rank memory."""

    layout: str
    memory: dict
    fits: bool
    speed: float


def plan(cfg: CfgNode, num_gpus: int, gpu_gib: float) -> tuple[Row | None, list[Row]]:
    """(the chosen layout or None when none fits, every candidate) for training
    `cfg` on `num_gpus` GPUs of `gpu_gib` GiB."""
    rows = []
    for layout, fsdp, ckpt in (
        ("ddp", False, False),
        ("fsdp", True, False),
        ("fsdp+ac", True, True),
    ):
        mem = per_rank_memory(cfg, num_gpus, fsdp, ckpt)
        fits = mem["total"] <= HEADROOM * gpu_gib * GIB
        rows.append(Row(layout, mem, fits, SPEED[layout]))
    fitting = [r for r in rows if r.fits]
    return (max(fitting, key=lambda r: r.speed) if fitting else None), rows


def format_plan(name: str, num_gpus: int, gpu_gib: float, best, rows) -> str:
    """The candidates as a text table (GiB per rank) and the choice."""
    lines = [
        f"{name} on {num_gpus} x {gpu_gib:g} GiB GPUs, GiB per rank "
        "(params / grads / optimizer / master / ema / gathered / activations = total):"
    ]
    for r in rows:
        parts = " / ".join(
            f"{r.memory[k] / GIB:.1f}"
            for k in (
                "params",
                "grads",
                "optimizer",
                "master",
                "ema",
                "gathered",
                "activations",
            )
        )
        mark = "fits" if r.fits else "does not fit"
        lines.append(f"  {r.layout:8s} {parts} = {r.memory['total'] / GIB:.1f}  {mark}")
    choice = best.layout if best else "none: needs tensor / pipeline parallelism"
    lines.append(f"  plan: {choice}")
    return "\n".join(lines)
