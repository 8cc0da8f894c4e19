"""Per-rank memory of a training layout, and the layout a run should use.

    mem = per_rank_memory(cfg, Candidate(pp=2, dp=4, tp=8, fsdp=True))  # bytes by part
    best, rows = plan(cfg, num_gpus=64, gpu_gib=80)  # plan_net.py, PARALLEL.AUTO

A candidate is a (pp, dp, tp) layout of the GPUs (parallel/mesh.py), DDP or FSDP over
its data-parallel ranks, with or without activation checkpointing. The parts, as
pycls_fast lays them out (exact per tensor, from the model built on the meta device,
so a 22B model costs nothing to plan), for the rank that holds the most:
- params, grads, optimizer state, fp32 master copies (AMP O2 without FSDP), the fp32
  EMA: tensor parallelism keeps 1/TP of each block matmul's weight (rows of
  attn_proj and linear_1 with their biases, columns of out_proj and linear_2) and
  the rest whole; a pipeline rank holds its stages' blocks (the first stage also the
  stem and tokens, the last the head: parallel/pipeline.py's `stage_bounds`, two stages
  per rank when interleaved); FSDP then keeps one
  dim-0 chunk of each tensor per data-parallel rank (the largest chunk, rank 0's);
- under FSDP, the weights gathered for computing (the block running and the one
  prefetched, in the compute dtype) and one block's unsharded gradients with the
  reduce-scatter's input made from them (in the reduce dtype); with
  TRAIN.ACCUM_STEPS > 1, the whole (TP-local) model's gradients unsharded between
  micro-batches (FSDP2 accumulates them unreduced while gradient sync is off), in
  the reduce dtype, counted in `grads`; in a pipeline, the rank's stages'
  gradients unsharded in the reduce dtype (torch's PipelineStage reduces after
  the last micro-batch) and, at the larger of two moments, either the end of a
  forward (two blocks' weights gathered, and under the interleaved schedule the
  rank's other stage's, left gathered by its backward) or the last backward
  (every stage's weights gathered, one micro-batch's activations);
- under AMP O1, autocast's cache of the half-precision casts of the Linear and
  Conv2d weights, held until the autocast context ends (the forward; a pipeline's
  whole step): a half copy of the rank's TP-local stage weights, FSDP or not
  (measured by engine/dry_run.py); under FSDP the cache is off and, in a
  pipeline, each (micro-batch, stage) forward in flight keeps its own casts of
  the stage's weights for its backward; in a pipeline without FSDP (the cache on),
  also the casts' half-precision gradients, which autograd holds to the end of
  each later micro-batch's backward (the cached casts' nodes are the oldest: run
  last), beyond what that micro-batch's freed activations make room for;
- with AMP.FP8, the float8 layers' weights gathered by FSDP in float8 (1 byte;
  tensorwise), none of their weights in autocast's cache (each use casts them to
  float8 and lets go), and the eager float8 casts of the largest operand (an fp32
  scaled copy, its clamp and the float8 result, 9 bytes an element of a micro-batch's
  tokens x MLP_DIM / TP), counted with the autocast casts;
- activations kept for backward, per block and image, by Korthikanti et al.
  ("Reducing Activation Recomputation in Large Transformer Models", 2022, eqs. 2-4):
  s*h*(34 + 5*a*s/h) bytes in 16-bit (twice in fp32), the 5*a*s/h of the
  attention matrix only where the kernel keeps one (VIT.ATTENTION as resolved on
  CUDA: 'explicit' or 'sdpa_math'; SDPA's fused kernels do not); with TP
  s*h*(10 + 24/t + 5*a*s/(h*t)), with sequence parallelism s*h*(34 + 5*a*s/h)/t
  plus the two whole-sequence inputs of the column-parallel matmuls that DTensor keeps
  (2*s*h in the compute dtype, not divided by t); with activation
  checkpointing each block keeps its input (s*h in the residual stream's dtype:
  fp32 under fp32 and O1, half under O2 / O3; /t with sequence parallelism) and
  one block's activations live at a time. A pipeline rank r keeps the
  activations of PP - r micro-batches in flight under 1F1B (of all of them under
  GPipe; under interleaved 1F1B its warm-up's forwards plus one, each through one
  of its stages: `interleaved_in_flight`, 1 + (PP-1)/(2*PP) times PP on the first).

The predicted step speed, as a fraction of the GPUs' ASSUMED_FLOPS, multiplies:
- the matmul size: t / (t + HALF_TOKENS) for t tokens per forward call (a
  data-parallel rank's batch, or one pipeline micro-batch);
- the pipeline bubble: m / (m + PP - 1) for m micro-batches (m / (m + (PP-1)/2)
  interleaved);
- tensor parallelism's all-reduces, not overlapped with compute: per block and
  step, 8 x (t-1)/t x s*b*h bytes in 16-bit over the link, against 72*s*b*h^2/t
  flops; at ASSUMED_FLOPS per GPU and ASSUMED_LINK bytes/s (NVLink within a node;
  TP is kept within NODE_GPUS);
- activation checkpointing: 3/4 (the forward is computed twice: 4/3 of the flops).
FSDP's and DDP's gradient reductions are taken as overlapped with backward.
"""

import functools
import math
from dataclasses import dataclass

import torch
from torch import nn
from yacs.config import CfgNode

from pycls_fast.components.float8 import is_float8_layer
from pycls_fast.components.optimizer import construct_optimizer
from pycls_fast.components.precision import AmpMode, resolve_amp
from pycls_fast.config import get_cfg, with_overrides
from pycls_fast.errors import UserError
from pycls_fast.models import build_model
from pycls_fast.models.attention import resolve_kernel
from pycls_fast.parallel.pipeline import stage_bounds, stages_per_rank
from pycls_fast.parallel.tensor_parallel import (
    COLUMN_SPLIT,
    ROW_SPLIT,
    sequence_parallel,
)

GIB = 2**30
HEADROOM = 0.9  # of a GPU's memory: the allocator's fragmentation, CUDA context
# Assumptions of the speed model (H100 SXM): 40% of the 989 TFLOP/s bf16 dense peak,
# and an NVLink all-reduce bus bandwidth of 300 GB/s; 8 GPUs per NVLink domain.
ASSUMED_FLOPS = 0.4 * 989e12
ASSUMED_LINK = 300e9
NODE_GPUS = 8
# The smallest pipeline micro-batch considered: below it a GPU's matmuls run far
# from their peak.
MIN_MICRO = 4
# Tokens per forward at which a block's matmuls run at half their large-batch speed
# (an assumption: launch and tile overheads; small micro-batches pay it).
HALF_TOKENS = 1024


@dataclass(frozen=True)
class Candidate:
    """A layout of the GPUs: pipeline x data x tensor parallel sizes, FSDP or DDP
    over the data-parallel ranks, activation checkpointing."""

    pp: int = 1
    dp: int = 1
    tp: int = 1
    fsdp: bool = False
    checkpoint: bool = False
    micro: int = 0  # pipeline micro-batches per step (0 without a pipeline)

    @property
    def name(self) -> str:
        dp = f"{'fsdp' if self.fsdp else 'ddp'}{self.dp}"
        parts = [f"pp{self.pp}m{self.micro}"] if self.pp > 1 else []
        parts += [dp] + ([f"tp{self.tp}"] if self.tp > 1 else [])
        return "x".join(parts) + ("+ac" if self.checkpoint else "")


def _param_tensors(cfg):
    """(name, shape, whether it sits in a LayerNorm, whether autocast casts it: a
    Linear's or Conv2d's) of each trainable parameter."""
    with torch.device("meta"):
        model = build_model(cfg)
    out = []
    for prefix, module in model.named_modules():
        for name, p in module.named_parameters(recurse=False):
            if p.requires_grad:
                full = f"{prefix}.{name}" if prefix else name
                is_ln = isinstance(module, nn.LayerNorm)
                cast = isinstance(module, (nn.Linear, nn.Conv2d))
                out.append((full, tuple(p.shape), is_ln, cast))
    return out


@functools.cache
def _block_of(name: str) -> int | None:
    if ".block_" not in name:
        return None
    return int(name.split(".block_")[1].split(".")[0])


def _by_stage(tensors, bounds) -> list[list]:
    """`tensors` (`_param_tensors`'s) split by the pipeline stage (of `bounds`) that
    holds each: a block's by its block; the final LayerNorm and the head on the
    last stage; the stem, class / distillation tokens and positions on the first."""
    of_block = [s for s, (lo, hi) in enumerate(bounds) for _ in range(lo, hi)]
    out = [[] for _ in bounds]
    for t in tensors:
        block = _block_of(t[0])
        if block is not None:
            out[of_block[block]].append(t)
        elif t[0].startswith(("encoder.ln", "head")):
            out[-1].append(t)
        else:
            out[0].append(t)
    return out


@functools.cache
def _tp_shape(name: str, shape, tp: int):
    if tp == 1 or not shape:
        return shape
    if any(f".{m}." in name for m in ROW_SPLIT):
        return (shape[0] // tp, *shape[1:])
    if any(f".{m}." in name for m in COLUMN_SPLIT) and name.endswith("weight"):
        return (shape[0], shape[1] // tp)
    return shape


def _local_numel(shape, dp, fsdp):
    if not fsdp or not shape:
        return math.prod(shape)
    return math.ceil(shape[0] / dp) * math.prod(shape[1:])


def _seq_len(cfg) -> int:
    prefix = int(cfg.VIT.CLASSIFIER_TYPE == "token") + int(cfg.VIT.DISTILL_TOKEN)
    return (cfg.TRAIN.IM_SIZE // cfg.VIT.PATCH_SIZE) ** 2 + prefix


def _microbatch_choices(cfg, pp: int, per_dp: int) -> list[int]:
    """PARALLEL.PP_MICROBATCHES when set, else 2 x PP, 4 x PP, ... while a
    micro-batch keeps at least MIN_MICRO images (and divides the batch)."""
    if cfg.PARALLEL.PP_MICROBATCHES:
        return [cfg.PARALLEL.PP_MICROBATCHES]
    out, m = [], 2 * pp
    while per_dp % m == 0 and per_dp // m >= MIN_MICRO:
        out.append(m)
        m *= 2
    return out or ([2 * pp] if per_dp % (2 * pp) == 0 else [])


def activation_bytes(
    cfg: CfgNode, images: int, checkpoint: bool, tp: int = 1, layers: int = 0
) -> int:
    """Bytes of activations kept for backward by `images` images through `layers`
    blocks (0: all), tensor-parallel over `tp` ranks (see the module docstring), in
    the precision of the AMP mode."""
    s, h, a = _seq_len(cfg), cfg.VIT.HIDDEN_DIM, cfg.VIT.NUM_HEADS
    n = layers or cfg.VIT.NUM_LAYERS
    mode, half = resolve_amp(cfg)
    if resolve_kernel(cfg.VIT.ATTENTION, "cuda", half) not in ("explicit", "sdpa_math"):
        # SDPA's fused kernels (flash, memory-efficient, cuDNN) keep the output and
        # the log-sum-exp, not the (a x s x s) attention matrix: no 5*a*s/h term.
        a = 0
    scale = 2.0 if mode is AmpMode.FP32 else 1.0
    sp = sequence_parallel(cfg, tp)
    if sp:
        per_block = s * h * (34 + 5 * a * s / h) / tp
    else:
        per_block = s * h * (10 + 24 / tp + 5 * a * s / (h * tp))
    per_block *= scale
    if sp:
        # DTensor's sequence parallelism keeps the all-gathered (whole-sequence)
        # inputs of attn_proj and linear_1 for their backward, as the matmuls'
        # compute dtype (Megatron gathers them again in backward): two s x h
        # tensors per block. Measured by engine/dry_run.py.
        per_block += 2 * s * h * (4 if mode is AmpMode.FP32 else 2)
    # The residual stream is fp32 under fp32 and O1 (autocast's adds of fp32
    # inputs), half under O2 / O3.
    stream_b = 4 if mode in (AmpMode.FP32, AmpMode.O1) else 2
    kept_input = s * h * stream_b / (tp if sp else 1)
    per_image = n * kept_input + per_block if checkpoint else n * per_block
    return int(per_image * images)


def per_rank_memory(cfg: CfgNode, c: Candidate, tensors=None) -> dict[str, int]:
    """Bytes by part (params, grads, optimizer, master, ema, gathered, activations,
    total) on the rank of candidate `c` that holds the most, training `cfg`.
    `tensors`: the model's `_param_tensors` when already listed."""
    tensors = tensors or _param_tensors(cfg)
    bounds = stage_bounds(cfg, c.pp * stages_per_rank(cfg, c.pp))
    by_stage = _by_stage(tensors, bounds)
    stages = [_stage_memory(cfg, c, r, bounds, by_stage) for r in range(c.pp)]
    return max(stages, key=lambda m: m["total"])


@functools.cache
def _states_of(name: str, momentum: float) -> int:
    cfg = with_overrides(
        get_cfg(),
        # Nesterov off: it only refuses a zero momentum, it keeps no other state.
        {"OPTIM.OPTIMIZER": name, "OPTIM.MOMENTUM": momentum, "OPTIM.NESTEROV": False},
    )
    p = nn.Parameter(torch.ones(8))
    opt = construct_optimizer([{"params": [p], "weight_decay": 0.0}], cfg)
    p.grad = torch.ones(8)
    opt.step()
    return sum(
        1
        for t in opt.state[p].values()
        if isinstance(t, torch.Tensor) and t.shape == p.shape
    )


def optimizer_states(cfg: CfgNode) -> int:
    """How many parameter-sized tensors OPTIM.OPTIMIZER keeps per parameter (SGD: 1
    with momentum, else 0; AdamW: 2; timm's Adan: 4 ...), counted on the real
    optimizer after one step on an 8-element parameter."""
    return _states_of(cfg.OPTIM.OPTIMIZER, cfg.OPTIM.MOMENTUM)


def rank_memory(cfg: CfgNode, c: Candidate, pp_rank: int, tensors=None) -> dict:
    """Bytes by part (as `per_rank_memory`) of the ranks of pipeline rank `pp_rank`
    in candidate `c` (tools/plan_net.py --dry-run compares them with a rank's)."""
    tensors = tensors or _param_tensors(cfg)
    bounds = stage_bounds(cfg, c.pp * stages_per_rank(cfg, c.pp))
    return _stage_memory(cfg, c, pp_rank, bounds, _by_stage(tensors, bounds))


@functools.cache
def _float8_param(name: str) -> bool:
    """Whether `name` is a parameter of a layer that AMP.FP8 makes float8."""
    return is_float8_layer(name.rsplit(".", 1)[0])


def _stage_memory(cfg, c: Candidate, rank: int, bounds, by_stage) -> dict[str, int]:
    """The bytes of pipeline rank `rank` (its stages rank and rank + PP);
    `by_stage`: the parameters of each stage (`_by_stage`)."""
    stages = list(range(rank, len(bounds), c.pp))
    mode, half = resolve_amp(cfg)
    # AMP.FP8 tensorwise under FSDP all-gathers the float8 layers' weights in
    # float8 (1 byte); their matmuls cast per use, nothing for autocast to cache.
    fp8_gather = c.fsdp and cfg.AMP.FP8_RECIPE == "tensorwise"
    block_fp8_numel = 0
    half_b = torch.finfo(half).bits // 8
    ln_fp32 = cfg.AMP.LAYER_NORM_FP32
    states = optimizer_states(cfg)
    out = dict.fromkeys(("params", "grads", "optimizer", "master", "ema"), 0)
    block_numel = autocast_numel = block_cast_numel = 0
    fp8, ema = cfg.AMP.FP8, cfg.OPTIM.EMA_ALPHA
    # Each of the rank's stages: (numel, float8 numel gathered in 1 byte).
    per_stage = {s: [0, 0] for s in stages}
    on_rank = [(s, t) for s in stages for t in by_stage[s]]
    for stage, (name, shape, is_ln, cast) in on_rank:
        shape = _tp_shape(name, shape, c.tp)
        float8 = bool(fp8) and _float8_param(name)
        cast = cast and not float8
        per_stage[stage][0] += math.prod(shape)
        if float8 and fp8_gather and name.endswith(".weight"):
            per_stage[stage][1] += math.prod(shape)
        autocast_numel += math.prod(shape) if cast else 0
        if _block_of(name) == bounds[stages[0]][0]:
            block_numel += math.prod(shape)
            block_cast_numel += math.prod(shape) if cast else 0
            if float8 and fp8_gather and name.endswith(".weight"):
                block_fp8_numel += math.prod(shape)
        n = _local_numel(shape, c.dp, c.fsdp)
        if mode is AmpMode.O3 or (
            mode is AmpMode.O2 and not c.fsdp and not (is_ln and ln_fp32)
        ):
            stored = half_b
        else:
            stored = 4
        out["params"] += n * stored
        # O2 without FSDP: the half grads move to the fp32 masters before the step.
        master = mode is AmpMode.O2 and not c.fsdp and stored != 4
        out["master"] += n * 4 if master else 0
        opt_b = 4 if master else stored
        out["grads"] += n * opt_b
        out["optimizer"] += states * n * opt_b
        out["ema"] += n * 4 if ema > 0 else 0
    stage_numel = sum(n for n, _ in per_stage.values())
    out["gathered"] = 0
    if c.fsdp:
        compute_b = half_b if mode in (AmpMode.O2, AmpMode.O3) else 4
        reduce_b = half_b if mode is AmpMode.O3 else 4
        # Two blocks' weights (the one running, the one prefetched), float8 ones
        # in 1 byte.
        two_blocks = 2 * ((block_numel - block_fp8_numel) * compute_b + block_fp8_numel)
        if c.pp > 1:
            # torch's PipelineStage keeps an FSDP stage's gradients unsharded from
            # its first backward to its last micro-batch's
            # (set_requires_gradient_sync(False)), accumulated in the reduce dtype
            # (fp32 under O1 and O2: _fsdp_param.py to_accumulated_grad_if_needed):
            # the rank's whole stages. Its weights stay gathered after a backward
            # (set_reshard_after_backward(False)) until the stage's next forward
            # reshards them block by block (FSDP.RESHARD_AFTER_FW). Two moments
            # can be the peak (measured by engine/dry_run.py, `_pipeline_peak`):
            # the end of a forward, with the most micro-batches in flight, the
            # forwarding stage's two blocks gathered and, interleaved, the rank's
            # other stage's weights from its last backward (0.70 GiB of gathered
            # fp32 weights at ViT-H's interleaved peak, 0.08 under 1F1B); and the
            # last backward, with every stage's weights gathered and one
            # micro-batch's activations (ViT-22B with checkpointing: 10.1 GiB
            # of weights and 10.1 of gradients at its peak). Here the first; the
            # second after the activations. Of two stages interleaved the
            # other is taken as the larger (none under GPipe and 1F1B).
            weights = sorted((n - f8) * compute_b + f8 for n, f8 in per_stage.values())
            grads_b = stage_numel * reduce_b
            out["gathered"] = int(grads_b + two_blocks + sum(weights[1:]))
        else:
            # A block's unsharded gradients (in the compute dtype) and FSDP2's
            # reduce-scatter input, made from them before they are freed (in the
            # reduce dtype: fp32 under O1 and O2, half under O3): both live at
            # once (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py
            # foreach_reduce, copy-in then `unsharded_grads.clear()`).
            out["gathered"] = int(two_blocks + block_numel * (compute_b + reduce_b))
            if cfg.TRAIN.ACCUM_STEPS > 1:
                # Between micro-batches the gradient reduction is off
                # (set_requires_gradient_sync(False)): FSDP2 keeps every
                # parameter's gradient unsharded, the rank's whole (TP-local)
                # model, in the reduce dtype (fp32 under O1 and O2, half under
                # O3), until the last micro-batch reduce-scatters it.
                out["grads"] += int(stage_numel * reduce_b)
    # O1's half-precision copies of the Linear / Conv2d weights: without FSDP
    # autocast's cache keeps them to the end of the forward (a pipeline's whole
    # step), a half copy of the rank's TP-local weights; under FSDP the cache is
    # off (components/precision.py `weight_cache`) and a cast lives as long as the
    # matmul that saved it for backward: every block's without activation
    # checkpointing, the recomputed block's with it.
    cast_numel = autocast_numel
    if c.fsdp and c.checkpoint:
        cast_numel = block_cast_numel
    out["autocast"] = cast_numel * half_b if mode is AmpMode.O1 else 0
    fp8_casts = 0
    images = cfg.TRAIN.BATCH_SIZE // c.dp // cfg.TRAIN.ACCUM_STEPS
    if cfg.AMP.FP8:
        # Float8's casts, counted with autocast's: torchao's eager cast of the
        # largest float8 operand (a micro-batch's tokens x MLP_DIM / TP: linear_2's
        # input, linear_1's output gradient) scales it in an fp32 copy, clamps it in
        # another and keeps the float8 result: 4 + 4 + 1 bytes an element, at the
        # step's peak (measured by engine/dry_run.py; compiled, the casts fuse).
        tokens = images / (c.micro if c.pp > 1 else 1) * _seq_len(cfg)
        fp8_casts = int(9 * tokens * cfg.VIT.MLP_DIM / c.tp)
        out["autocast"] += fp8_casts
    layers = sum(bounds[s][1] - bounds[s][0] for s in stages)
    if c.pp > 1:
        m = c.micro
        micro = images / m
        schedule = cfg.PARALLEL.PP_SCHEDULE
        # Micro-batches whose activations the stage keeps at its peak.
        if schedule == "gpipe":
            in_flight = m
        elif schedule == "1f1b":
            in_flight = min(m, c.pp - rank)
        else:
            in_flight = interleaved_in_flight(c.pp, len(stages), m, rank)
        images = micro * in_flight
    out["activations"] = activation_bytes(cfg, images, c.checkpoint, c.tp, layers)
    if c.fsdp and c.pp > 1:
        # O1 under FSDP without checkpointing: autocast's cache is off, so each
        # micro-batch's forward through a stage casts its weights again and keeps
        # the casts for that backward, one set per (micro-batch, stage) in flight
        # (measured by engine/dry_run.py: 5 sets of a ViT-H stage's at the
        # interleaved schedule's peak on the first rank, 2.5 micro-batches
        # through its 2); the last backward holds one stage's set. The other
        # casts (float8's, the recomputed block's) are counted once.
        per_set = cast_numel * half_b if mode is AmpMode.O1 and not c.checkpoint else 0
        others = out["autocast"] - per_set
        out["autocast"] = others + int(per_set * in_flight)
        casts = others + per_set // len(stages)
        gathered = grads_b + sum(weights)
        out.update(_pipeline_peak(cfg, c, out, stages, bounds, micro, gathered, casts))
    if mode is AmpMode.O1 and c.pp > 1 and not c.fsdp:
        # With autocast's cache on (not under FSDP), the casts are cached for the
        # whole step: made in the first micro-batch's forward, their autograd
        # nodes are older than a later micro-batch's graph, and autograd runs the
        # newest nodes first, so in each later backward the half-precision
        # gradients of all the stage's casts wait until its end (measured by
        # engine/dry_run.py: 4.85 GiB for ViT-22B's stage at TP 4 with the cache
        # on). They take the place of that micro-batch's activations as its
        # backward frees them: the peak holds the larger of the two.
        one_micro = out["activations"] / in_flight
        out["autocast"] += int(max(0, out["autocast"] - one_micro))
    out["total"] = sum(out.values())
    return out


def _pipeline_peak(
    cfg, c, fwd, stages, bounds, micro, gathered, casts
) -> dict[str, int]:
    """The parts of an FSDP pipeline rank during its last backward, when they hold
    more than `fwd` (those at a forward's end, as `_stage_memory` counts them),
    else {}: `gathered` (every stage's weights and gradients unsharded), one
    micro-batch's activations through its largest stage, and its `casts`."""
    layers = max(bounds[s][1] - bounds[s][0] for s in stages)
    bwd = {
        "gathered": int(gathered),
        "activations": activation_bytes(cfg, micro, c.checkpoint, c.tp, layers),
        "autocast": int(casts),
    }
    return bwd if sum(bwd.values()) > sum(fwd[k] for k in bwd) else {}


def interleaved_in_flight(pp: int, v: int, m: int, rank: int) -> float:
    """The micro-batches whose activations pipeline rank `rank` keeps at its peak
    under torch's interleaved 1F1B (`v` stages per rank, `m` micro-batches), in
    units of one micro-batch through all the rank's stages: the forwards of its
    warm-up (torch/distributed/pipelining/schedules.py `_get_warmup_ops`: rounds
    of min(m, PP) micro-batches, (v - 1) rounds plus 2 per rank before the last),
    plus the first steady-state forward, each through one of its v stages."""
    rounds = max(1, m // pp)
    per_round = m // rounds
    warmup = min((v - 1) * per_round + 2 * (pp - 1 - rank), v * m)
    chunks = warmup + (1 if warmup < v * m else 0)
    return chunks / v


def predicted_speed(cfg: CfgNode, c: Candidate) -> float:
    """Predicted step throughput, as a fraction of what the GPUs would do at
    ASSUMED_FLOPS with no communication and full-size matmuls (module docstring)."""
    speed = 0.75 if c.checkpoint else 1.0
    images = cfg.TRAIN.BATCH_SIZE / c.dp / cfg.TRAIN.ACCUM_STEPS
    if c.pp > 1:
        m = c.micro
        idle = (c.pp - 1) / (2 if cfg.PARALLEL.PP_SCHEDULE == "interleaved" else 1)
        speed *= m / (m + idle)
        images /= m
    tokens = images * _seq_len(cfg)
    speed *= tokens / (tokens + HALF_TOKENS)
    if c.tp > 1:
        h = cfg.VIT.HIDDEN_DIM
        # Per block, token and step: communicated bytes over compute time.
        comm = 8 * (c.tp - 1) / c.tp * h * 2 / ASSUMED_LINK
        compute = 72 * h * h / c.tp / ASSUMED_FLOPS
        speed *= 1.0 / (1.0 + comm / compute)
    return speed


@dataclass
class Row:
    """One candidate layout and its predicted per-rank memory and speed."""

    layout: Candidate
    memory: dict
    fits: bool
    speed: float


def candidates(cfg: CfgNode, num_gpus: int) -> list[Candidate]:
    """The layouts of `num_gpus` GPUs that `cfg` can use: TP within NODE_GPUS and
    dividing the heads and MLP width; PP up to the layers (half of them when
    interleaved); the batch split evenly over DP (and its micro-batches)."""
    vit, out = cfg.VIT, []
    schedule = cfg.PARALLEL.PP_SCHEDULE
    for tp in (1, 2, 4, 8):
        if tp > min(NODE_GPUS, num_gpus) or vit.NUM_HEADS % tp or vit.MLP_DIM % tp:
            continue
        for pp in range(1, num_gpus // tp + 1):
            per_rank_stages = 2 if schedule == "interleaved" and pp > 1 else 1
            if num_gpus % (tp * pp) or pp * per_rank_stages > vit.NUM_LAYERS:
                continue
            dp = num_gpus // (tp * pp)
            batch = cfg.TRAIN.BATCH_SIZE
            if batch % dp:
                continue
            micros = _microbatch_choices(cfg, pp, batch // dp) if pp > 1 else [0]
            for fsdp, ckpt in ((False, False), (True, False), (True, True)):
                if not fsdp and tp > 1 and dp > 1:
                    continue  # TP with data parallelism needs FSDP (config check)
                for m in micros:
                    out.append(Candidate(pp, dp, tp, fsdp, ckpt, m))
    return out


def plan(cfg: CfgNode, num_gpus: int, gpu_gib: float) -> tuple[Row | None, list[Row]]:
    """(the chosen layout or None when none fits, every candidate) for training
    `cfg` on `num_gpus` GPUs of `gpu_gib` GiB: the fastest predicted layout that
    fits; among equals, the simplest (least model parallelism, DDP before FSDP)."""
    rows, tensors = [], _param_tensors(cfg)
    for c in candidates(cfg, num_gpus):
        mem = per_rank_memory(cfg, c, tensors)
        fits = mem["total"] <= HEADROOM * gpu_gib * GIB
        rows.append(Row(c, mem, fits, predicted_speed(cfg, c)))
    fitting = [r for r in rows if r.fits]
    if not fitting:
        return None, rows
    best = max(
        fitting,
        key=lambda r: (
            round(r.speed, 3),
            -r.layout.tp * r.layout.pp,
            not r.layout.fsdp,
        ),
    )
    return best, rows


_PARTS = (
    "params",
    "grads",
    "optimizer",
    "master",
    "ema",
    "gathered",
    "autocast",
    "activations",
)


def format_plan(
    name: str, num_gpus: int, gpu_gib: float, best, rows, show: int = 8
) -> str:
    """The plan as a text table (GiB per rank): the chosen layout and the `show`
    fastest others that fit, then the fastest that do not, at least 2 (0: all
    rows)."""
    lines = [
        f"{name} on {num_gpus} x {gpu_gib:.3g} GiB GPUs, GiB per rank "
        "(params / grads / optimizer / master / ema / gathered / autocast / activations"
        " = total),"
        " predicted speed as a fraction of the assumed peak:"
    ]
    ranked = sorted(rows, key=lambda r: (not r.fits, -r.speed, r.memory["total"]))
    if show:
        fits = [r for r in ranked if r.fits][:show]
        misses = [r for r in ranked if not r.fits][: max(2, show - len(fits))]
        ranked = fits + misses
    for r in ranked:
        parts = " / ".join(f"{r.memory[k] / GIB:.1f}" for k in _PARTS)
        mark = "fits" if r.fits else "does not fit"
        chosen = "  <- plan" if best is not None and r.layout == best.layout else ""
        lines.append(
            f"  {r.layout.name:18s} {parts} = {r.memory['total'] / GIB:.1f}  "
            f"{mark}, speed {r.speed:.2f}{chosen}"
        )
    if best is None:
        lines.append(
            "  plan: none fits: more GPUs, or fewer images per step (TRAIN.ACCUM_STEPS,"
            " PARALLEL.PP_MICROBATCHES, TRAIN.BATCH_SIZE); under FSDP,"
            " TRAIN.ACCUM_STEPS keeps the whole gradients unsharded between"
            " micro-batches (counted above)"
        )
    else:
        c = best.layout
        lines.append(
            f"  plan: {c.name}: PARALLEL.PP {c.pp} PARALLEL.TP {c.tp} FSDP.ENABLED "
            f"{c.fsdp} FSDP.ACTIVATION_CHECKPOINT {c.checkpoint}"
            + (f" PARALLEL.PP_MICROBATCHES {c.micro}" if c.pp > 1 else "")
        )
    return "\n".join(lines)


def fit_in_one_process(cfg: CfgNode, gib: float) -> tuple[CfgNode, int]:
    """`cfg` run as one process (no TP or PP split; FSDP, if on, over one rank)
    trimmed to fit in HEADROOM of `gib` GiB: (cfg with the most encoder blocks that
    fit, the config's own block count). The step per block is what a rank of the
    real layout runs per block, so its time scales with the blocks. UserError
    naming the memory when not even one block fits."""
    layers = cfg.VIT.NUM_LAYERS
    one = Candidate(fsdp=cfg.FSDP.ENABLED, checkpoint=cfg.FSDP.ACTIVATION_CHECKPOINT)

    def need(n: int) -> int:
        return per_rank_memory(with_overrides(cfg, {"VIT.NUM_LAYERS": n}), one)["total"]

    limit = HEADROOM * gib * GIB
    if need(layers) <= limit:
        return cfg, layers
    lo, hi = 0, layers  # need(lo) fits (0: none), need(hi) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if need(mid) <= limit else (lo, mid)
    if lo == 0:
        raise UserError(
            f"one rank of this config as one process needs "
            f"{need(1) / GIB:.1f} GiB with a single block "
            f"({cfg.TRAIN.BATCH_SIZE} images), more than {HEADROOM:.0%} of the "
            f"{gib:.1f} GiB here: a smaller TRAIN.BATCH_SIZE, or "
            "FSDP.ACTIVATION_CHECKPOINT True"
        )
    return with_overrides(cfg, {"VIT.NUM_LAYERS": lo}), layers


def device_gib(device: torch.device, local_ranks: int) -> float:
    """Memory one rank may use on `device`: the GPU's, or on CPU this machine's
    memory shared by its `local_ranks` processes."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / GIB
    import psutil

    return psutil.virtual_memory().total / GIB / max(local_ranks, 1)


def auto_layout(cfg: CfgNode, gpu_gib: float) -> tuple[CfgNode, str]:
    """PARALLEL.AUTO: (cfg with the planned PARALLEL.TP / PP, FSDP.ENABLED and
    FSDP.ACTIVATION_CHECKPOINT, the plan's table); UserError when no layout fits.
    Deterministic: every rank plans the same."""
    best, rows = plan(cfg, cfg.NUM_GPUS, gpu_gib)
    table = format_plan("PARALLEL.AUTO", cfg.NUM_GPUS, gpu_gib, best, rows)
    if best is None:
        raise UserError(
            f"PARALLEL.AUTO: no layout of {cfg.NUM_GPUS} devices of {gpu_gib:.1f} GiB "
            "fits this model and batch (python tools/plan_net.py shows the table)"
        )
    c = best.layout
    planned = {
        "PARALLEL.TP": c.tp,
        "PARALLEL.PP": c.pp,
        "FSDP.ENABLED": c.fsdp,
        "FSDP.ACTIVATION_CHECKPOINT": c.checkpoint,
        "PARALLEL.PP_MICROBATCHES": c.micro,
        "PARALLEL.AUTO": False,  # planned once: a resumed run keeps this layout
    }
    return with_overrides(cfg, planned), table
