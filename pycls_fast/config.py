"""Configuration (yacs): defaults with their limits, load + merge + validate, dump.

Every key of pycls's config schema is accepted with pycls's meaning, so a pycls ViT
config file loads unchanged. Keys that are new to pycls_fast live in their own nodes
(AMP, DATA) or are marked "pycls_fast" in their comment. Each key is declared by one
`_key(NAME, DEFAULT, limits...)` line: the comment above it is its documentation,
and docs/CONFIG.md is generated from both (tools/gen_config_doc.py).

Usage:
    cfg = load_cfg("configs/vit/ViT-B-16.yaml", ["OPTIM.BASE_LR", "0.001"])
    model = build_model(cfg)
    cfg2 = with_overrides(cfg, {"NUM_GPUS": 2})   # a new checked, frozen config

There is no global config: `get_cfg()` returns a fresh, mutable copy of the defaults;
`load_cfg` and `with_overrides` return frozen, checked configs.

One switch per concept: pycls's aliases (TRAIN.MIXED_PRECISION, FSDP.MIXED_PRECISION,
FSDP.LAYER_NORM_FP32, FSDP.DO_NOT_RESHARD_AFTER_FW, DATA_LOADER.MODE 'pytorch') are
resolved onto pycls_fast's key at load (`_resolve_aliases`): an alias decides only
when the file and the overrides leave the key it maps onto unset.

Keys accepted for pycls compatibility but not acted on are listed in `IGNORED`; the
values that pycls_fast does not implement are refused by the rules in `_REFUSALS`.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import difflib
import logging
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import yaml
from yacs.config import CfgNode

from pycls_fast.errors import ConfigError

logger = logging.getLogger(__name__)

_C = CfgNode()


@dataclasses.dataclass(frozen=True)
class Limit:
    """The values a key accepts, declared beside its default by `_key`.

    `choices`: the allowed values (compared case-insensitively with `casefold`);
    `gt`, `ge`, `lt`, `le`: bounds of a number; `check`: a predicate on the value,
    `rule` the words for it ("KEY must be RULE").
    """

    choices: tuple | None = None
    gt: float | None = None
    ge: float | None = None
    lt: float | None = None
    le: float | None = None
    check: Callable[[Any], bool] | None = None
    rule: str = ""
    casefold: bool = False

    def describe(self) -> str:
        """The limit in words, e.g. "> 0", "in [0, 1)", "one of 'a', 'b'"."""
        if self.choices is not None:
            return "one of " + ", ".join(repr(c) for c in self.choices)
        if self.check is not None:
            return self.rule
        lo = (
            ("(", self.gt) if self.gt is not None
            else ("[", self.ge) if self.ge is not None
            else None
        )  # fmt: skip
        hi = (
            (")", self.lt) if self.lt is not None
            else ("]", self.le) if self.le is not None
            else None
        )  # fmt: skip
        if lo and hi:
            return f"in {lo[0]}{lo[1]}, {hi[1]}{hi[0]}"
        if lo:
            return f"{'>' if lo[0] == '(' else '>='} {lo[1]}"
        return f"{'<' if hi[0] == ')' else '<='} {hi[1]}"

    def error(self, key: str, value: Any) -> str | None:
        """The one-line complaint about `value` for `key`, or None when it is fine."""
        if self.choices is not None:
            seen = value.lower() if self.casefold and isinstance(value, str) else value
            if seen in self.choices:
                return None
            hint = _suggest(value, self.choices) if isinstance(value, str) else ""
            return f"{key} must be one of {list(self.choices)}, got {value!r}{hint}"
        if self.check is not None:
            ok = self.check(value)
        else:
            ok = (
                (self.gt is None or value > self.gt)
                and (self.ge is None or value >= self.ge)
                and (self.lt is None or value < self.lt)
                and (self.le is None or value <= self.le)
            )
        return None if ok else f"{key} must be {self.describe()}, got {value!r}"


# Each key's limits, by key, filled by `_key` beside the default.
LIMITS: dict[str, Limit] = {}


def _key(name: str, default: Any, **limits: Any) -> None:
    """Declares the config key `name` (dotted) with its default and its limits (the
    fields of `Limit`); the comment right above the call documents it."""
    *path, leaf = name.split(".")
    node = _C
    for part in path:
        node = node[part]
    node[leaf] = default
    if limits:
        if "choices" in limits:
            limits["choices"] = tuple(limits["choices"])
        LIMITS[name] = Limit(**limits)


def _crop_range(v: Sequence[float]) -> bool:
    return len(v) == 2 and 0.0 < v[0] <= v[1] <= 1.0


def _rgb(v: Sequence[float]) -> bool:
    return len(v) == 3 and all(isinstance(x, (int, float)) for x in v)


def _rgb_positive(v: Sequence[float]) -> bool:
    return _rgb(v) and all(x > 0 for x in v)


_SBATCH_ARG = re.compile(r"^[A-Za-z][A-Za-z0-9_-]*(=.*)?$")


def _sbatch_args(v: Sequence[str]) -> bool:
    return all(isinstance(a, str) and _SBATCH_ARG.match(a) for a in v)


def _steps_from_zero(v: Sequence[float]) -> bool:
    return not v or v[0] == 0


# ---------------------------------- Model options ----------------------------------- #
_C.MODEL = CfgNode()

# Model type (only 'vit' is implemented)
_key("MODEL.TYPE", "vit", choices=["vit"], casefold=True)

# Number of weight layers (pycls; unused by ViT, which reads VIT.NUM_LAYERS)
_key("MODEL.DEPTH", 0)

# Number of classes
_key("MODEL.NUM_CLASSES", 1000, gt=0)

# Loss function ('cross_entropy'; label smoothing and mixup targets are handled by it)
_key("MODEL.LOSS_FUN", "cross_entropy", choices=["cross_entropy"])

# Activation function of the conv stem (pycls; only 'relu' is implemented, others are
# refused; the MLP uses gelu)
_key("MODEL.ACTIVATION_FUN", "relu")

# Perform activation inplace if implemented
_key("MODEL.ACTIVATION_INPLACE", True)

# Model scaling type (pycls; unused by ViT)
_key("MODEL.SCALING_TYPE", "")

# Model scaling factor (pycls; unused by ViT)
_key("MODEL.SCALING_FACTOR", 1.0)


# ---------------------------------- ResNet options ---------------------------------- #
# pycls's CNN families: accepted so that pycls config files load, unused by ViT.
_C.RESNET = CfgNode()

# Transformation function (pycls; unused)
_key("RESNET.TRANS_FUN", "basic_transform")

# Number of groups (pycls; unused)
_key("RESNET.NUM_GROUPS", 1)

# Width of each group (pycls; unused)
_key("RESNET.WIDTH_PER_GROUP", 64)

# Apply stride to 1x1 conv (pycls; unused)
_key("RESNET.STRIDE_1X1", True)


# ---------------------------------- AnyNet options ---------------------------------- #
_C.ANYNET = CfgNode()

# Stem type (pycls; unused)
_key("ANYNET.STEM_TYPE", "simple_stem_in")

# Stem width (pycls; unused)
_key("ANYNET.STEM_W", 32)

# Block type (pycls; unused)
_key("ANYNET.BLOCK_TYPE", "res_bottleneck_block")

# Depth for each stage (pycls; unused)
_key("ANYNET.DEPTHS", [])

# Width for each stage (pycls; unused)
_key("ANYNET.WIDTHS", [])

# Strides for each stage (pycls; unused)
_key("ANYNET.STRIDES", [])

# Bottleneck multipliers for each stage (pycls; unused)
_key("ANYNET.BOT_MULS", [])

# Group widths for each stage (pycls; unused)
_key("ANYNET.GROUP_WS", [])

# Head width (pycls; unused)
_key("ANYNET.HEAD_W", 0)

# Whether SE is enabled (pycls; unused)
_key("ANYNET.SE_ON", False)

# SE ratio (pycls; unused)
_key("ANYNET.SE_R", 0.25)


# ---------------------------------- RegNet options ---------------------------------- #
_C.REGNET = CfgNode()

# Stem type (pycls; unused)
_key("REGNET.STEM_TYPE", "simple_stem_in")

# Stem width (pycls; unused)
_key("REGNET.STEM_W", 32)

# Block type (pycls; unused)
_key("REGNET.BLOCK_TYPE", "res_bottleneck_block")

# Stride of each stage (pycls; unused)
_key("REGNET.STRIDE", 2)

# Squeeze-and-Excitation on (pycls; unused)
_key("REGNET.SE_ON", False)

# Squeeze-and-Excitation ratio (pycls; unused)
_key("REGNET.SE_R", 0.25)

# Depth (pycls; unused)
_key("REGNET.DEPTH", 10)

# Initial width (pycls; unused)
_key("REGNET.W0", 32)

# Slope (pycls; unused)
_key("REGNET.WA", 5.0)

# Quantization (pycls; unused)
_key("REGNET.WM", 2.5)

# Group width (pycls; unused)
_key("REGNET.GROUP_W", 16)

# Bottleneck multiplier (pycls; unused)
_key("REGNET.BOT_MUL", 1.0)

# Head width (pycls; unused)
_key("REGNET.HEAD_W", 0)


# ------------------------------- EfficientNet options ------------------------------- #
_C.EN = CfgNode()

# Stem width (pycls; unused)
_key("EN.STEM_W", 32)

# Depth for each stage (pycls; unused)
_key("EN.DEPTHS", [])

# Width for each stage (pycls; unused)
_key("EN.WIDTHS", [])

# Expansion ratios for MBConv blocks (pycls; unused)
_key("EN.EXP_RATIOS", [])

# Squeeze-and-Excitation ratio (pycls; unused)
_key("EN.SE_R", 0.25)

# Strides for each stage (pycls; unused)
_key("EN.STRIDES", [])

# Kernel sizes for each stage (pycls; unused)
_key("EN.KERNELS", [])

# Head width (pycls; unused)
_key("EN.HEAD_W", 1280)

# Drop connect ratio (pycls; unused)
_key("EN.DC_RATIO", 0.0)

# Dropout ratio (pycls; unused)
_key("EN.DROPOUT_RATIO", 0.0)


# ---------------------------- Vision Transformer options ---------------------------- #
_C.VIT = CfgNode()

# Patch size (TRAIN.IM_SIZE must be divisible by PATCH_SIZE)
_key("VIT.PATCH_SIZE", 16, gt=0)

# Type of stem, 'patchify' or 'conv' (https://arxiv.org/abs/2106.14881)
_key("VIT.STEM_TYPE", "patchify", choices=["patchify", "conv"])

# Conv-stem kernel sizes; all but the last are 3x3 convs, the last is typically 1
_key("VIT.C_STEM_KERNELS", [])

# Conv-stem strides (their product must equal PATCH_SIZE)
_key("VIT.C_STEM_STRIDES", [])

# Conv-stem output widths (the last must equal HIDDEN_DIM)
_key("VIT.C_STEM_DIMS", [])

# Number of encoder blocks
_key("VIT.NUM_LAYERS", 12, gt=0)

# Number of self-attention heads (HIDDEN_DIM must be divisible by it)
_key("VIT.NUM_HEADS", 12, gt=0)

# Hidden (token) width
_key("VIT.HIDDEN_DIM", 768, gt=0)

# Width of the MLP in each encoder block
_key("VIT.MLP_DIM", 3072, gt=0)

# Classifier: 'token' (class token) or 'pooled' (final LayerNorm, mean over tokens)
_key("VIT.CLASSIFIER_TYPE", "token", choices=["token", "pooled"])

# pycls_fast: token tensor layout inside the encoder, 'batch_second' (seq, batch,
# hidden) or 'batch_first' (batch, seq, hidden); both give identical outputs
_key("VIT.LAYOUT", "batch_second", choices=["batch_second", "batch_first"])

# pycls_fast: attention kernel, 'auto' (fastest measured for the device and dtype),
# 'sdpa' (torch scaled_dot_product_attention, backend picked by torch), 'sdpa_flash',
# 'sdpa_math', 'sdpa_efficient', 'sdpa_cudnn' (one SDPA backend) or 'explicit'
# (matmul, softmax, matmul). 'sdpa_flash' and 'sdpa_cudnn' take fp16 / bf16 inputs
# on CUDA only, so they are refused with AMP.MODE 'fp32' (`ATTENTION_NEEDS_HALF`)
_key(
    "VIT.ATTENTION",
    "auto",
    choices=[
        "auto",
        "sdpa",
        "sdpa_flash",
        "sdpa_math",
        "sdpa_efficient",
        "sdpa_cudnn",
        "explicit",
    ],
)

# The attention kernels that need half-precision inputs (checked in check_cfg).
ATTENTION_NEEDS_HALF = ("sdpa_flash", "sdpa_cudnn")

# pycls_fast: LayerScale initial value (DeiT III: a learned per-channel scale of each
# residual branch, 1e-4 at every size; weight-decayed as LN); 0 = off
_key("VIT.LAYER_SCALE", 0.0, ge=0)

# pycls_fast: QK-normalization (ViT-22B; timm's qk_norm): a LayerNorm over each
# head's queries and keys before the dot product, bounding the attention logits that
# cause loss spikes in large ViTs. Under PARALLEL.TP > 1 each rank normalizes its own
# heads and the norms' gradients are summed over the ranks
_key("VIT.QK_NORM", False)

# pycls_fast: compute the attention (logits, softmax, weighted sum) in float32 under
# AMP, the projections staying in half precision; slower, for stability
_key("VIT.ATTENTION_FP32", False)

# pycls_fast: DeiT's distillation token: a second token and head trained against the
# teacher (DISTILL.*); evaluation averages the two heads (needs the token classifier)
_key("VIT.DISTILL_TOKEN", False)

# pycls_fast: stochastic depth rate of the last block (linearly increasing from 0)
_key("VIT.DROP_PATH", 0.0, ge=0, lt=1)


# -------------------------------- Batch norm options -------------------------------- #
_C.BN = CfgNode()

# BN epsilon (used by the conv stem)
_key("BN.EPS", 1e-5, gt=0)

# BN momentum (BN momentum in PyTorch = 1 - BN momentum in Caffe2)
_key("BN.MOM", 0.1)

# Precise BN stats (pycls): after each training epoch, the BatchNorm running mean and
# var are recomputed as their average over BN.NUM_SAMPLES_PRECISE training images.
# Only the conv stem (VIT.STEM_TYPE conv) has BatchNorm; for other models it is a
# no-op, said once in the log
_key("BN.USE_PRECISE_STATS", False)

# Number of training images (over all processes) for precise BN stats
_key("BN.NUM_SAMPLES_PRECISE", 8192, gt=0)

# Initialize the gamma of the final BN of each block to zero (pycls; unused by ViT)
_key("BN.ZERO_INIT_FINAL_GAMMA", False)

# Use a different weight decay for BN layers
_key("BN.USE_CUSTOM_WEIGHT_DECAY", False)

# The weight decay for BN layers when USE_CUSTOM_WEIGHT_DECAY is on
_key("BN.CUSTOM_WEIGHT_DECAY", 0.0)


# -------------------------------- Layer norm options -------------------------------- #
_C.LN = CfgNode()

# LayerNorm epsilon (timm's ViT uses 1e-6)
_key("LN.EPS", 1e-5, gt=0)

# Use a different weight decay for LN layers
_key("LN.USE_CUSTOM_WEIGHT_DECAY", False)

# The weight decay for LN layers (and LayerScale gammas) when USE_CUSTOM_WEIGHT_DECAY
# is on
_key("LN.CUSTOM_WEIGHT_DECAY", 0.0)


# -------------------------------- Optimizer options --------------------------------- #
_C.OPTIM = CfgNode()

# Optimizer: 'sgd', 'adam', 'adamw' (torch's, fused with OPTIM.MTA), or any optimizer
# of timm's optimizer factory ('lamb', 'lars', 'lion', 'adan', 'nadamw', ...:
# timm.optim.list_optimizers()), built by the factory over the same parameter groups
_key("OPTIM.OPTIMIZER", "sgd")

# Base learning rate
_key("OPTIM.BASE_LR", 0.1, ge=0)

# The learning rate decays from BASE_LR to MIN_LR * BASE_LR according to LR_POLICY
_key("OPTIM.MIN_LR", 0.0, ge=0)

# Learning rate policy: 'cos', 'exp', 'lin' or 'steps'
_key("OPTIM.LR_POLICY", "cos", choices=["cos", "exp", "lin", "steps"])

# Steps for the 'steps' policy, in epochs (the first must be 0)
_key("OPTIM.STEPS", [], check=_steps_from_zero, rule="[] or a list starting at 0")

# Learning rate multiplier for the 'steps' policy
_key("OPTIM.LR_MULT", 0.1)

# Exponential decay factor (older pycls configs; 'exp' now decays to MIN_LR)
_key("OPTIM.GAMMA", 0.1)

# Maximal number of epochs
_key("OPTIM.MAX_EPOCH", 200, gt=0)

# Momentum (sgd)
_key("OPTIM.MOMENTUM", 0.9)

# Momentum dampening (sgd)
_key("OPTIM.DAMPENING", 0.0)

# Nesterov momentum (sgd)
_key("OPTIM.NESTEROV", True)

# Beta1 (adam, adamw, lamb)
_key("OPTIM.BETA1", 0.9)

# Beta2 (adam, adamw, lamb)
_key("OPTIM.BETA2", 0.999)

# Weight decay (L2 for sgd/adam, decoupled for adamw/lamb)
_key("OPTIM.WEIGHT_DECAY", 5e-4, ge=0)

# Use a different weight decay for all biases (excluding those in BN/LN layers)
_key("OPTIM.BIAS_USE_CUSTOM_WEIGHT_DECAY", False)

# The weight decay for biases when BIAS_USE_CUSTOM_WEIGHT_DECAY is on
_key("OPTIM.BIAS_CUSTOM_WEIGHT_DECAY", 0.0)

# pycls_fast: no weight decay on the position embedding and the class and
# distillation tokens (timm's VisionTransformer.no_weight_decay, which DeiT and DeiT
# III train with); False decays them as pycls does
_key("OPTIM.NO_DECAY_TOKENS", False)

# Start the warm up from BASE_LR * WARMUP_FACTOR
_key("OPTIM.WARMUP_FACTOR", 0.1)

# Gradually warm up to BASE_LR over this number of epochs
_key("OPTIM.WARMUP_EPOCHS", 0, ge=0)

# Exponential moving average (EMA) of the weights, update value (0 turns EMA off)
_key("OPTIM.EMA_ALPHA", 1e-5, ge=0)

# Iteration period with which to update the EMA weights (after iterations 0, P, 2P,
# ... of each epoch, as pycls; alpha scales with P and the batch in use)
_key("OPTIM.EMA_UPDATE_PERIOD", 32, gt=0)

# Multi-tensor-apply optimizer updates (torch foreach / fused) instead of a loop
_key("OPTIM.MTA", False)

# pycls_fast: layer-wise learning-rate decay d (BEiT / DeiT III fine-tuning, timm's
# rule): block i of L (from 0) trains at lr x d^(L - i), the stem and embeddings at
# lr x d^(L + 1), the final norm as the last block, the head at lr; 1.0 = off
_key("OPTIM.LAYER_DECAY", 1.0, gt=0, le=1)

# pycls_fast: clip the global gradient norm to this value (0 turns clipping off)
_key("OPTIM.GRAD_CLIP", 0.0, ge=0)

# pycls_fast: update the learning rate every iteration (False: once per epoch, as pycls)
_key("OPTIM.LR_PER_ITER", True)


# --------------------------------- Training options --------------------------------- #
_C.TRAIN = CfgNode()

# Dataset name (pycls; pycls_fast reads images from DATA.PATH)
_key("TRAIN.DATASET", "imagenet")

# Split (folder under DATA.PATH) to train on
_key("TRAIN.SPLIT", "train")

# Total mini-batch size, over all processes
_key("TRAIN.BATCH_SIZE", 128, gt=0)

# pycls_fast: gradient accumulation: each process's share of TRAIN.BATCH_SIZE runs
# forward and backward in this many micro-batches before the one optimizer step
# (gradients synchronized on the last only). TRAIN.BATCH_SIZE stays the batch of one
# step, so learning-rate rules, schedules and logs keep their meaning
_key("TRAIN.ACCUM_STEPS", 1, gt=0)

# pycls_fast: progressive resolution: stages [[first epoch, image size, batch size],
# ...] from epoch 0, e.g. [[0, 128, 2048], [40, 176, 1536], [80, 224, 1024]]; the
# last stage's size is TRAIN.IM_SIZE (the model's position embedding, interpolated
# at run time for the smaller ones); batch sizes global as TRAIN.BATCH_SIZE, which
# they replace. [] = TRAIN.IM_SIZE and TRAIN.BATCH_SIZE throughout
_key("TRAIN.SIZE_SCHEDULE", [])

# pycls_fast: loss-spike guard: a step whose loss is not finite or above this many
# times the running mean of the accepted losses is skipped (logged), instead of
# stopping on a NaN; 0 = off (a NaN stops the run). Reads the loss back every step
_key("TRAIN.SPIKE_FACTOR", 0.0, ge=0)

# pycls_fast: accepted steps before the guard judges against the running mean (a
# non-finite loss is skipped from the first step)
_key("TRAIN.SPIKE_WARMUP", 50, ge=0)

# pycls_fast: stop the run (naming the last good checkpoint) after this many steps
# in a row skipped as spikes
_key("TRAIN.SPIKE_MAX_SKIPS", 5, gt=0)

# Training image size (random-resized-crop output; the model's input size)
_key("TRAIN.IM_SIZE", 224, gt=0)

# Evaluate the model every this many epochs
_key("TRAIN.EVAL_PERIOD", 1, gt=0)

# Save a checkpoint every this many epochs
_key("TRAIN.CHECKPOINT_PERIOD", 1, gt=0)

# pycls_fast: also save a checkpoint every this many iterations (0: only per epoch)
_key("TRAIN.CHECKPOINT_ITER_PERIOD", 0, ge=0)

# pycls_fast: keep only the newest this many checkpoints (epoch and iteration ones
# alike), deleting older ones after each save (0: keep all)
_key("TRAIN.CHECKPOINT_KEEP", 0, ge=0)

# pycls_fast: never delete the checkpoint of lowest test top-1 error (of the model,
# not the EMA); checkpoints/best.json names it with its epoch and top1_err
_key("TRAIN.CHECKPOINT_KEEP_BEST", False)

# pycls_fast: write checkpoints beside training: a save stalls training only while
# the state is copied to host memory (pinned on a GPU), then a background thread
# (single files) or DCP's async_save (FSDP) writes it; a new save waits for the
# previous write, and the run does not end before its last write is complete
# (docs/RELIABILITY.md). Stop-signal checkpoints are always written synchronously
_key("TRAIN.CHECKPOINT_ASYNC", False)

# Resume training from the newest complete checkpoint in OUT_DIR (False: start
# anew; refused where OUT_DIR holds checkpoints, which it would overwrite)
_key("TRAIN.AUTO_RESUME", True)

# pycls_fast: keys (comma-separated, or 'all') whose change from the config of the
# checkpoints in OUT_DIR a rerun accepts. A change that alters what the checkpoints
# mean (model, optimizer, schedule, data) is otherwise refused, naming the keys;
# logging, loader, launch and checkpoint-cadence keys may change freely. Accepted
# changes are logged, and the replaced config.yaml is kept in OUT_DIR/config_history
_key("TRAIN.ACCEPT_CHANGES", "")

# pycls_fast: under several processes, agree on a stop signal (SIGTERM, Ctrl-C;
# one collective and one host read) every this many iterations and at the end of
# each epoch, so a stopped run exits within this many steps (one process: every
# step, at no cost)
_key("TRAIN.PREEMPT_CHECK_PERIOD", 10, gt=0)

# Weights to start training from
_key("TRAIN.WEIGHTS", "")

# pycls_fast: with TRAIN.WEIGHTS of another class count, skip the head.* tensors
# whose shape differs and keep the freshly initialised classifier (fine-tuning)
_key("TRAIN.RESET_HEAD", False)

# Train with mixed precision (pycls): an alias of AMP.MODE 'O1' (autocast, fp32
# weights), used only when AMP.MODE is not set (see AMP.MODE)
_key("TRAIN.MIXED_PRECISION", False)

# pycls_fast: torch.compile the trained model: 'off', 'block' (each encoder block on
# its own, as torchtitan does: composes with FSDP2 and activation checkpointing, one
# compilation shared by all blocks) or 'model' (the whole model, before DDP wraps it).
# Compilation happens in the first steps (minutes for large models on a GPU; needs a
# C++ compiler on a CPU)
_key("TRAIN.COMPILE", "off", choices=["off", "block", "model"])

# pycls_fast: replay the model's forward and backward as CUDA graphs (torch.compile's
# mode 'reduce-overhead'): the host launches a graph instead of each kernel, so the
# step no longer waits for the Python thread (nor for the GIL). Compiles the whole
# model (TRAIN.COMPILE 'model' or 'off'); training batches keep their size (a bad
# image is replaced, as with DATA_LOADER.REPLACE_BAD). One GPU or DDP: refused with
# FSDP, TP and PP, whose hooks run between the kernels. On a CPU it compiles as
# TRAIN.COMPILE 'model' does (no graphs)
_key("TRAIN.CUDA_GRAPHS", False)

# pycls_fast: training loss: 'ce' (cross-entropy with soft targets, pycls) or 'bce'
# (binary cross-entropy per class, DeiT III; timm's BinaryCrossEntropy); evaluation
# reports cross-entropy either way
_key("TRAIN.LOSS", "ce", choices=["ce", "bce"])

# pycls_fast: TRAIN.LOSS bce: targets above this become 1, the others 0 (timm's
# target_threshold, e.g. 0.2 with mixup); 0 = soft targets as they are
_key("TRAIN.BCE_TARGET_THRESH", 0.0, ge=0, lt=1)

# pycls_fast: TRAIN.LOSS bce: every class with a target above 0 becomes 1 (DeiT III's
# `targets.gt(0.0)` after mixup / cutmix: both mixed classes are positives; timm's
# target_threshold 0); needs TRAIN.BCE_TARGET_THRESH 0
_key("TRAIN.BCE_BINARY_TARGETS", False)

# Label smoothing value in 0 to 1 (0 gives no smoothing)
_key("TRAIN.LABEL_SMOOTHING", 0.0, ge=0, lt=1)

# Batch mixup alpha (0 gives no mixup)
_key("TRAIN.MIXUP_ALPHA", 0.0, ge=0)

# Batch cutmix alpha (0 gives no cutmix)
_key("TRAIN.CUTMIX_ALPHA", 0.0, ge=0)

# Standard deviation of AlexNet-style PCA lighting jitter (0 gives none)
_key("TRAIN.PCA_STD", 0.1, ge=0)

# Data augmentation: a timm augmentation string through timm's own factories
# ('rand-m9-mstd0.5-inc1' as DeiT, 'augmix-m5-w4-d2', 'original', ...), or pycls's
# 'AutoAugment', 'RandAugment_N2_M0.5' ('' = none)
_key("TRAIN.AUGMENT", "")

# pycls_fast: interpolation of TRAIN.AUGMENT's geometric ops (timm's aa_params):
# 'random' (one of bilinear / bicubic per op, timm's default), 'bicubic' (DeiT's
# --train-interpolation) or 'bilinear'
_key("TRAIN.AUGMENT_INTERPOLATION", "random", choices=["random", "bicubic", "bilinear"])

# pycls_fast: where TRAIN.AUGMENT, TRAIN.THREE_AUGMENT and TRAIN.COLOR_JITTER run:
# 'tensor' (torch ops on the uint8 crop in the decoding thread: Pillow's pixels, the
# GIL released, every draw from the image's own seed, so batches are reproducible and
# the same in every loader mode), 'pil' (the reference: the crop resized by Pillow,
# then timm's and torchvision's PIL operations; timm draws from the global random) or
# 'device' (all three on the uint8 batch on the training device, batched per op
# with per-image draws, Pillow's pixels: the decoding threads only crop and flip;
# AugMix refused. For GPUs: on a CPU it is the training thread's work)
_key("TRAIN.AUGMENT_BACKEND", "tensor", choices=["tensor", "pil", "device"])

# pycls_fast: repeated augmentation (DeiT's RASampler): each image this many times
# in a row of the epoch's order, each copy with its own augmentation, the epoch as
# long as before (1/this many of the images per epoch); 1 = off (DeiT uses 3)
_key("TRAIN.REPEATED_AUG", 1, gt=0)

# pycls_fast: DeiT III's 3-Augment: per image one of grayscale, solarization, Gaussian
# blur (after the crop and flip)
_key("TRAIN.THREE_AUGMENT", False)

# pycls_fast: colour jitter strength x: brightness, contrast and saturation factors
# uniform in [1 - x, 1 + x], in a random order (torchvision's ColorJitter(x, x, x));
# 0 = off (DeiT III uses 0.3)
_key("TRAIN.COLOR_JITTER", 0.0, ge=0)

# pycls_fast: random erasing probability per train image (timm's RandomErasing on the
# normalized image, on the device, before mixup); 0 = off (DeiT uses 0.25)
_key("TRAIN.RANDOM_ERASE", 0.0, ge=0, le=1)

# pycls_fast: random erasing fill: 'pixel' (per-pixel normal noise), 'rand' (one
# normal colour per box) or 'const' (zeros, the mean colour)
_key("TRAIN.RANDOM_ERASE_MODE", "pixel", choices=["pixel", "rand", "const"])

# pycls_fast: random erasing boxes per image: 1 to this many (the area is shared)
_key("TRAIN.RANDOM_ERASE_COUNT", 1, gt=0)


# --------------------------------- Testing options ---------------------------------- #
_C.TEST = CfgNode()

# Dataset name (pycls; pycls_fast reads images from DATA.PATH)
_key("TEST.DATASET", "imagenet")

# Split (folder under DATA.PATH) to evaluate on
_key("TEST.SPLIT", "val")

# Total mini-batch size, over all processes
_key("TEST.BATCH_SIZE", 200, gt=0)

# pycls_fast: test_net evaluates at each of these crop sizes (the model built at that
# size, its position embedding interpolated; the resize keeps the crop ratio
# TRAIN.IM_SIZE / TEST.IM_SIZE); [] = TRAIN.IM_SIZE only
_key("TEST.SIZES", [])

# pycls_fast: test_net also evaluates on these split folders of DATA.PATH (e.g. an
# ImageNet-V2 folder, whose class folders 0..999 are read as label numbers;
# ImageNet-Sketch; ImageNet-A / -R, whose 200 synset folders are read from the
# logits of those classes only)
_key("TEST.EXTRA_SPLITS", [])

# pycls_fast: ImageNet-ReaL labels (real.json, brought by the user): test_net also
# reports top-1 under them for TEST.SPLIT (images named ILSVRC2012_val_<number>)
_key("TEST.REAL_LABELS", "")

# Resize the shorter side to this size, then center-crop TRAIN.IM_SIZE (pycls)
_key("TEST.IM_SIZE", 256, gt=0)

# Weights to evaluate
_key("TEST.WEIGHTS", "")

# pycls_fast: evaluate the EMA weights of TEST.WEIGHTS when the checkpoint has them
_key("TEST.USE_EMA", False)


# ----------------------------------- Data options ----------------------------------- #
# pycls_fast: where the images are.
_C.DATA = CfgNode()

# Dataset root: one folder per split (TRAIN.SPLIT, TEST.SPLIT), one folder per class;
# a local path or an fsspec URL (s3://bucket/imagenet, with the user's s3fs installed)
_key("DATA.PATH", "")

# pycls_fast: 'folder' (<split>/<class>/<image> files) or 'shards' (tar shards and their
# index, written by tools/pack_dataset.py: no open or stat per image)
_key("DATA.FORMAT", "folder", choices=["folder", "shards"])

# pycls_fast: DATA.FORMAT shards: images shuffled together within each window of this
# many consecutive images of the epoch's shard order (spanning a few shards), the
# shards themselves in a permuted order
_key("DATA.SHUFFLE_BUFFER", 16384, gt=0)

# pycls_fast: random-resized-crop area range, as fractions of the image (timm's scale)
_key("DATA.CROP_SCALE", [0.08, 1.0], check=_crop_range, rule="[min, max] in (0, 1]")

# pycls_fast: train crop: 'random_resized' (area DATA.CROP_SCALE, aspect 3/4-4/3) or
# 'simple_random' (DeiT III's SRC: shorter side resized, 4-pixel reflect pad, crop)
_key("DATA.TRAIN_CROP", "random_resized", choices=["random_resized", "simple_random"])

# pycls_fast: probability of a horizontal flip of a train image
_key("DATA.HFLIP", 0.5, ge=0, le=1)

# pycls_fast: channel order the model sees: 'rgb', or 'bgr' as pycls's ImageNet loader
# feeds it (BGR pixels, each channel with its own mean and std); weights trained by
# pycls expect 'bgr'. 'auto': the order the weights loaded (TEST.WEIGHTS, or
# TRAIN.WEIGHTS when training) expect: 'bgr' for a pycls checkpoint, the saved order
# for a pycls_fast one, else 'rgb' (the run's config.yaml records the choice)
_key("DATA.CHANNEL_ORDER", "auto", choices=["auto", "rgb", "bgr"])

# pycls_fast: per-channel mean subtracted from the [0, 1] RGB pixels before dividing
# by DATA.STD (pycls's and timm's ImageNet statistics by default; the same for
# training, evaluation and pycls_fast.engine.inference)
_key("DATA.MEAN", [0.485, 0.456, 0.406], check=_rgb, rule="3 numbers (R, G, B)")

# pycls_fast: per-channel standard deviation the pixels are divided by, RGB order
_key("DATA.STD", [0.229, 0.224, 0.225], check=_rgb_positive, rule="3 numbers > 0")

# Cache each split's file index in OUT_DIR/data_index (rescanned when a folder changes)
_key("DATA.INDEX_CACHE", True)


# ------------------------------- Data loader options -------------------------------- #
_C.DATA_LOADER = CfgNode()

# Number of decoding threads ('threads', 'spdl', 'subprocess' modes) or worker
# processes ('processes')
_key("DATA_LOADER.NUM_WORKERS", 8, ge=0)

# Load data to pinned host memory (applies when training on a GPU)
_key("DATA_LOADER.PIN_MEMORY", True)

# pycls_fast: 'auto' (the mode measured best for the device the step runs on:
# 'subprocess' on a GPU, 'threads' on the CPU; datasets/loader.py MEASURED_BEST_MODE),
# 'threads' (in-process decoding threads), 'spdl' (the same in an spdl.pipeline),
# 'subprocess' (the same threads in DATA_LOADER.SUBPROCESSES child processes, batches
# in shared memory: the training thread keeps its GIL) or 'processes' (torch
# DataLoader); every mode yields the same batches. pycls's 'pytorch' loads as
# 'processes', its 'ffcv' is refused (not implemented)
_key(
    "DATA_LOADER.MODE",
    "auto",
    choices=["auto", "threads", "spdl", "subprocess", "processes", "pytorch", "ffcv"],
)

# pycls_fast: child processes of 'subprocess' mode, sharing DATA_LOADER.NUM_WORKERS
# threads between them (more than one when one process's GIL is the limit)
_key("DATA_LOADER.SUBPROCESSES", 1, ge=1)

# pycls_fast: abort when more than this fraction of images fail to decode
_key("DATA_LOADER.MAX_BAD_FRAC", 0.01, ge=0, lt=1)

# pycls_fast: in training, give a bad image's place in its batch to another image
# (drawn from RNG_SEED, the epoch and the image; still counted and logged as bad), so
# every batch has TRAIN.BATCH_SIZE images: the static shapes that CUDA graphs and
# compiled steps want (always so with TRAIN.CUDA_GRAPHS); False drops it (its batch
# is one image smaller)
_key("DATA_LOADER.REPLACE_BAD", False)

# pycls_fast: batches decoded or being decoded ahead of the training step, per process
# (at least one per worker plus one)
_key("DATA_LOADER.PREFETCH", 4, gt=0)

# pycls_fast: log decoding throughput, task time and queue occupancy every this many
# seconds ('threads' mode: logger pycls_fast.datasets.modes.threaded; 'spdl' mode:
# logger spdl.pipeline; 0 turns it off)
_key("DATA_LOADER.STATS_PERIOD", 0.0, ge=0)


# ------------------------------ Mixed precision options ----------------------------- #
# pycls_fast: automatic mixed precision modes.
_C.AMP = CfgNode()

# The precision switch: 'fp32', 'O1' (autocast, fp32 weights), 'O2' (half weights,
# fp32 master weights in the optimizer), 'O3' (everything in half precision). Set in
# the file or an override, it always wins over pycls's aliases; left '' (unset), it
# follows them: 'O2' when FSDP.ENABLED and FSDP.MIXED_PRECISION, else 'O1' when
# TRAIN.MIXED_PRECISION, else 'fp32'. A loaded config holds the resolved mode
_key("AMP.MODE", "", choices=["", "fp32", "O1", "O2", "O3"])

# Half-precision type: 'bf16' or 'fp16' (fp16 uses dynamic loss scaling)
_key("AMP.DTYPE", "bf16", choices=["bf16", "fp16"])

# Keep LayerNorm (and the conv stem's BatchNorm) weights and compute in fp32 under
# O2, with or without FSDP. Unset in the file and the overrides, it follows pycls's
# FSDP.LAYER_NORM_FP32
_key("AMP.LAYER_NORM_FP32", True)

# fp32 matmuls and convolutions on CUDA use TF32 tensor cores (10-bit mantissa
# inputs, fp32 accumulation), as most training codebases do; False keeps IEEE fp32.
# GPU only (Ampere and later); set once per process (precision.apply_backend_flags)
_key("AMP.TF32", True)

# Float8 training (torchao.float8): the encoder blocks' linear layers (q/k/v,
# projection, MLP) run their matmuls on float8 inputs, scaled dynamically; the stem,
# head and norms keep AMP.MODE's precision (components/float8.py). Needs a GPU with
# float8 matmuls (compute capability 8.9+: H100, H200, L4), AMP.DTYPE bf16, and
# VIT.HIDDEN_DIM and VIT.MLP_DIM (divided by PARALLEL.TP) multiples of 16. Use it
# with TRAIN.COMPILE (torch.compile fuses float8's casts; a warning says so when off)
_key("AMP.FP8", False)

# AMP.FP8's scaling: 'tensorwise' (one scale per tensor; e4m3 inputs and weights,
# e5m2 gradients; FSDP all-gathers the weights in float8) or 'rowwise' (a power-of-2
# scale per row, e4m3 throughout; more accurate, a little slower)
_key("AMP.FP8_RECIPE", "tensorwise", choices=["tensorwise", "rowwise"])

# AMP.FP8's matmuls emulated (torchao's emulate): the float8 values multiplied in
# fp32, so float8's roundings without float8 kernels, on any device; no speed-up. For
# tests on CPUs and GPUs without float8
_key("AMP.FP8_EMULATE", False)


# ---------------------------------- CUDNN options ----------------------------------- #
_C.CUDNN = CfgNode()

# Let cuDNN benchmark convolution algorithms (GPU only; best for fixed input sizes)
_key("CUDNN.BENCHMARK", True)


# ---------------------------------- Memory options ---------------------------------- #
# Older pycls configs carry this node.
_C.MEM = CfgNode()

# Perform ReLU inplace (older pycls; see MODEL.ACTIVATION_INPLACE)
_key("MEM.RELU_INPLACE", True)


# --------------------------------- Profiling options -------------------------------- #
# pycls_fast: a torch.profiler trace of a few training steps (docs/PERFORMANCE.md,
# "Profiling a run"), written to OUT_DIR/profile/
_C.PROF = CfgNode()

# Profile training steps (Chrome trace and an operator table per rank)
_key("PROF.ENABLED", False)

# Steps of this process before the profiled ones (warm-up)
_key("PROF.START", 10, ge=0)

# Steps profiled
_key("PROF.STEPS", 5, gt=0)

# On CUDA, also record the allocator's history over those steps (memory snapshot)
_key("PROF.MEMORY", True)


# ------------------------------- Precise time options ------------------------------- #
_C.PREC_TIME = CfgNode()

# Number of iterations to warm up the caches before timing
_key("PREC_TIME.WARMUP_ITER", 3, ge=0)

# Number of iterations to average the time over
_key("PREC_TIME.NUM_ITER", 30, gt=0)


# ------------------------------- Distillation options ------------------------------- #
# pycls_fast: DeiT's knowledge distillation (docs/RECIPES.md, "Distillation")
_C.DISTILL = CfgNode()

# 'none', 'soft' (KL divergence to the teacher's tempered softmax) or 'hard' (cross-
# entropy to the teacher's top-1 class, DeiT's choice)
_key("DISTILL.TYPE", "none", choices=["none", "soft", "hard"])

# Weight of the distillation loss: loss = (1 - alpha) x base + alpha x distillation
_key("DISTILL.ALPHA", 0.5, ge=0, le=1)

# Temperature of soft distillation
_key("DISTILL.TAU", 1.0, gt=0)

# The teacher's config file (its model keys; its TRAIN.IM_SIZE and MODEL.NUM_CLASSES
# are the student's)
_key("DISTILL.TEACHER_CFG", "")

# The teacher's weights: a pycls_fast or pycls checkpoint, or a timm ViT state dict
# (converted on load)
_key("DISTILL.TEACHER_WEIGHTS", "")


# ---------------------------------- Launch options ---------------------------------- #
# pycls's launcher keys: 'local' runs here (NUM_GPUS processes, or under torchrun);
# 'slurm' and 'submitit_local' submit the job through submitit (docs/DISTRIBUTED.md).
_C.LAUNCH = CfgNode()

# Launch mode: 'local', 'slurm' (sbatch through submitit, one task per GPU) or
# 'submitit_local' (submitit's local executor: the same job as processes here)
_key("LAUNCH.MODE", "local", choices=["local", "slurm", "submitit_local"])

# Times a job stopped by the time-limit signal is requeued (it resumes from OUT_DIR);
# SLURM requeues a preempted job itself
_key("LAUNCH.MAX_RETRY", 3, ge=0)

# SLURM job name
_key("LAUNCH.NAME", "pycls_fast_job")

# SLURM job comment
_key("LAUNCH.COMMENT", "")

# CPUs per GPU (per task) requested from SLURM
_key("LAUNCH.CPUS_PER_GPU", 10, gt=0)

# Memory per GPU (per task) in GB requested from SLURM; 0 = the cluster's default
# (pycls's FAIR value: 60; configs/launch/pycls_fair.yaml)
_key("LAUNCH.MEM_PER_GPU", 0, ge=0)

# SLURM partition; '' = the cluster's default partition (pycls's FAIR value: devlab)
_key("LAUNCH.PARTITION", "")

# SLURM GPU type constraint (--constraint); '' = none (pycls's FAIR value: volta)
_key("LAUNCH.GPU_TYPE", "")

# pycls_fast: more sbatch options, each 'name=value' or a bare 'name' flag, e.g.
# ['account=vision', 'qos=high', 'exclusive'] (--account=vision --qos=high
# --exclusive); they win over the options the keys above make
_key(
    "LAUNCH.SBATCH_ARGS",
    [],
    check=_sbatch_args,
    rule="a list of 'name=value' or 'name'",
)

# pycls_fast: print the job that would be submitted (sbatch script or submitit
# parameters, nodes x tasks x GPUs, the command each task runs, the log paths)
# and submit nothing
_key("LAUNCH.DRY_RUN", False)

# SLURM time limit in minutes (submitit_local: the job is stopped after it too)
_key("LAUNCH.TIME_LIMIT", 4200, gt=0)

# Email for SLURM notifications (end and failure)
_key("LAUNCH.EMAIL", "")

# pycls_fast: a partition without GPUs: no GPUs requested, ranks use gloo; each of
# the NUM_GPUS ranks is one task (MAX_GPUS_PER_NODE of them per node)
_key("LAUNCH.CPU_ONLY", False)

# pycls_fast: seconds before the time limit at which SLURM sends USR2 (--signal):
# the run writes a checkpoint and the job is requeued (LAUNCH.MAX_RETRY)
_key("LAUNCH.SIGNAL_DELAY_S", 120, gt=0)

# pycls_fast: the submitting tool waits for the job and reports its result or
# failure (pycls returns at once: False)
_key("LAUNCH.WAIT", False)


# ----------------------------------- FSDP options ----------------------------------- #
_C.FSDP = CfgNode()

# Shard parameters, gradients and optimizer state across processes (torch fully_shard)
_key("FSDP.ENABLED", False)

# Free the gathered parameters after forward (saves memory, costs communication).
# Unset in the file and the overrides, it follows pycls's DO_NOT_RESHARD_AFTER_FW
_key("FSDP.RESHARD_AFTER_FW", True)

# pycls's alias of AMP.LAYER_NORM_FP32, used only when that is not set
_key("FSDP.LAYER_NORM_FP32", True)

# Older pycls FSDP key: the inverse of RESHARD_AFTER_FW, used only when that is not set
_key("FSDP.DO_NOT_RESHARD_AFTER_FW", False)

# Older pycls FSDP key: half-precision FSDP compute, an alias of AMP.MODE 'O2' (with
# FSDP.ENABLED) used only when AMP.MODE is not set
_key("FSDP.MIXED_PRECISION", False)

# pycls_fast: recompute each encoder block's activations in backward (saves memory);
# also without FSDP
_key("FSDP.ACTIVATION_CHECKPOINT", False)


# ---------------------------- Tensor / pipeline parallel ---------------------------- #
# pycls_fast: model parallelism for ViTs too large for data parallelism alone, on a
# (pp, dp, tp) device mesh of NUM_GPUS = PP x DP x TP ranks (see docs/DISTRIBUTED.md)
_C.PARALLEL = CfgNode()

# Tensor-parallel ranks: each encoder block's heads and MLP columns split across them
# (Megatron's column / row split, with DTensor); 1 = off
_key("PARALLEL.TP", 1, gt=0)

# With TP > 1: shard the token sequence across the tensor-parallel ranks around the
# LayerNorms and residual adds (sequence parallelism: activations / TP there); it
# applies when every token count of the run divides by TP (else the sequence stays
# whole, and the log says so)
_key("PARALLEL.SEQUENCE_PARALLEL", True)

# Pipeline stages: the encoder split into PP stages of balanced cost (the stem with the
# first, the head with the last); 1 = off
_key("PARALLEL.PP", 1, gt=0)

# Pipeline schedule: GPipe (all forwards, then all backwards), 1F1B (PipeDream-flush)
# or interleaved 1F1B (two stages per rank)
_key("PARALLEL.PP_SCHEDULE", "1f1b", choices=["gpipe", "1f1b", "interleaved"])

# Micro-batches per step and data-parallel rank in a pipeline (0 = 2 x PP)
_key("PARALLEL.PP_MICROBATCHES", 0, ge=0)

# Let the planner choose PARALLEL.TP, PARALLEL.PP, PARALLEL.PP_MICROBATCHES,
# FSDP.ENABLED and FSDP.ACTIVATION_CHECKPOINT for NUM_GPUS devices of this machine's
# memory: the fastest predicted layout that fits (tools/plan_net.py prints the table)
_key("PARALLEL.AUTO", False)


# ------------------------------- Distributed options -------------------------------- #
# pycls_fast: multi-process runs (see docs/DISTRIBUTED.md).
_C.DIST = CfgNode()

# Seconds a collective may wait for the other ranks before the job stops with an error
# (a rank that died or hangs never stalls the others for longer)
_key("DIST.TIMEOUT_S", 600, gt=0)

# Seconds the ranks wait for each other around the downloads of a remote OUT_DIR
# (its files before the run; the checkpoint files each node reads at the resume): a
# wait of its own, not DIST.TIMEOUT_S, since a node's share of a large checkpoint
# may take longer to arrive than a collective should ever wait
_key("DIST.PULL_TIMEOUT_S", 7200, gt=0)


# ----------------------------------- Misc options ----------------------------------- #
# Optional description of a config
_key("DESC", "")

# If True output additional info to the log
_key("VERBOSE", True)

# Number of processes (devices) to use; outside torchrun, N local processes are spawned;
# under torchrun its world size replaces this value (docs/DISTRIBUTED.md)
_key("NUM_GPUS", 1, gt=0)

# Maximum number of GPUs per node (pycls): a SLURM job of NUM_GPUS ranks gets
# ceil(NUM_GPUS / MAX_GPUS_PER_NODE) nodes, one task per GPU
_key("MAX_GPUS_PER_NODE", 8, gt=0)

# Output directory (logs, checkpoints, config.yaml); a local path or an fsspec URL
# (s3://bucket/runs/vit, with the user's s3fs installed), worked on through OUT_MIRROR
_key("OUT_DIR", "/tmp/pycls_fast", check=lambda v: bool(v.strip()), rule="a folder")

# pycls_fast: local mirror folder of a remote OUT_DIR (training writes there, and the
# checkpoints and logs are uploaded from there); '' = a folder under the system's
# temporary folder named by the URL's hash
_key("OUT_MIRROR", "")

# Config destination (in OUT_DIR)
_key("CFG_DEST", "config.yaml")

# Random seed (CPU runs are deterministic; GPU kernels may not be)
_key("RNG_SEED", 1)

# Log destination: 'stdout' (stdout and OUT_DIR/stdout.log) or 'file' (only the file)
_key("LOG_DEST", "stdout", choices=["stdout", "file"])

# Log period in iterations
_key("LOG_PERIOD", 10, gt=0)

# pycls_fast: also write every stats record as TensorBoard scalars to OUT_DIR/tb_log
# (`<type>/<field>`, as pycls's vitconfigs branch; needs the tensorboard package).
# OUT_DIR/epoch_stats.csv (a row per epoch record) is always written
_key("LOG_TENSORBOARD", False)

# pycls_fast: also send the config, every stats record, the plots and the final
# metrics to a Weights & Biases run (main process only; needs the wandb package);
# the run's id is kept in OUT_DIR/wandb_id, so a resumed run continues it
_key("LOG_WANDB", False)

# Distributed backend ('nccl' on GPUs; CPU runs always use 'gloo')
_key("DIST_BACKEND", "nccl", choices=["nccl", "gloo", "mpi", "ucc"])

# Hostname for multi-process groups outside torchrun
_key("HOST", "localhost")

# Port range for multi-process groups (the port is picked at random)
_key("PORT_RANGE", [10000, 65000])

# Fixed port (older pycls configs; 0 means pick one from PORT_RANGE)
_key("PORT", 0)

# Local cache for weights referred to by URL (pycls; pycls_fast never downloads)
_key("DOWNLOAD_CACHE", "/tmp/pycls-download-cache")


# --------------------------------- Weights & Biases --------------------------------- #
# pycls_fast: the W&B run of LOG_WANDB True (docs/GETTING_STARTED.md)
_C.WANDB = CfgNode()

# Project of the run
_key("WANDB.PROJECT", "pycls_fast")

# Entity (user or team) owning the run ('': the logged-in user's default)
_key("WANDB.ENTITY", "")

# Display name of the run ('': OUT_DIR's folder name)
_key("WANDB.NAME", "")

# Tags of the run
_key("WANDB.TAGS", [])

# 'online' (sends to the server), 'offline' (writes OUT_DIR/wandb only, for
# `wandb sync` later) or 'disabled'; the WANDB_MODE environment variable wins
_key("WANDB.MODE", "online", choices=["online", "offline", "disabled"])


# -------------------------------------- MFU ---------------------------------------- #
# pycls_fast: model FLOP utilization in the train records (docs/PERFORMANCE.md, MFU)
_C.MFU = CfgNode()

# One device's dense peak TFLOP/s for the dtype in use (0: the GPU's from the table
# of known GPUs, or on a CPU a matmul measured once and cached)
_key("MFU.PEAK_TFLOPS", 0.0, ge=0.0)


# ----------------------------- Accepted, not acted on ------------------------------ #
# Every key that loads for pycls compatibility but that nothing in pycls_fast reads,
# with the reason; a node stands for all of its keys. A non-default value logs one
# warning per key and process, naming it, unless a rule of `_REFUSALS` refuses it.
# (tests/test_config.py checks that no module reads these keys.)
IGNORED: dict[str, str] = {
    "MODEL.DEPTH": "pycls's CNN depth; ViT reads VIT.NUM_LAYERS",
    "MODEL.ACTIVATION_FUN": "the conv stem uses relu and the MLP gelu",
    "MODEL.SCALING_TYPE": "pycls's model scaling tool",
    "MODEL.SCALING_FACTOR": "pycls's model scaling tool",
    "RESNET": "pycls's ResNet family; pycls_fast builds ViT only",
    "ANYNET": "pycls's AnyNet family; pycls_fast builds ViT only",
    "REGNET": "pycls's RegNet family; pycls_fast builds ViT only",
    "EN": "pycls's EfficientNet family; pycls_fast builds ViT only",
    "BN.ZERO_INIT_FINAL_GAMMA": "ViT blocks have no BN",
    "OPTIM.GAMMA": "older pycls's 'exp' factor; 'exp' decays to OPTIM.MIN_LR",
    "TRAIN.DATASET": "images are read from DATA.PATH/TRAIN.SPLIT",
    "TEST.DATASET": "images are read from DATA.PATH/TEST.SPLIT",
    "MEM.RELU_INPLACE": "older pycls; MODEL.ACTIVATION_INPLACE is read",
    "VERBOSE": "the log is the same either way",
    "DOWNLOAD_CACHE": "pycls_fast never downloads weights",
}


@dataclasses.dataclass(frozen=True)
class _Refusal:
    """A value pycls_fast does not implement: `refused(cfg)` says whether `cfg` asks
    for it; `at_launch` rules apply when a tool starts the job (`check_launch`), the
    others when the config is loaded (loading for inspection must still work)."""

    key: str
    refused: Callable[[CfgNode], bool]
    instead: str
    doc: str  # the refused values, for docs/CONFIG.md
    at_launch: bool = False


# The values of keys whose silent ignoring would run something other than what the
# config asks for: refused (exit status 2) until they are implemented.
_REFUSALS = [
    _Refusal(
        "MODEL.ACTIVATION_FUN",
        lambda c: c.MODEL.ACTIVATION_FUN.lower() != "relu",
        "the conv stem uses relu",
        "refused: all but 'relu'",
    ),
    _Refusal(
        "OPTIM.GAMMA",
        lambda c: c.OPTIM.LR_POLICY == "exp" and c.OPTIM.GAMMA != _DEFAULTS.OPTIM.GAMMA,
        "'exp' decays from BASE_LR to MIN_LR * BASE_LR over MAX_EPOCH; set "
        "OPTIM.MIN_LR (GAMMA ** MAX_EPOCH) instead",
        "refused: a non-default value with LR_POLICY 'exp'",
    ),
    _Refusal(
        "DATA_LOADER.MODE",
        lambda c: c.DATA_LOADER.MODE == "ffcv",
        "use 'auto' (the default), 'threads', 'spdl', 'subprocess' or 'processes'",
        "refused: 'ffcv'",
    ),
]

# Keys that older pycls versions had and that mean nothing now: dropped when read.
_DEPRECATED_KEYS = {"PREC_TIME.BATCH_SIZE", "PREC_TIME.ENABLED"}

_DEFAULTS = _C.clone()
_DEFAULTS.freeze()

# Where a loaded config keeps the keys its file and overrides set (yacs keeps its own
# flags in a CfgNode's __dict__ the same way; clone and pickle carry them).
_EXPLICIT = "__explicit_keys__"


def get_cfg() -> CfgNode:
    """Returns a fresh, mutable copy of the default config (not checked)."""
    cfg = _DEFAULTS.clone()
    cfg.defrost()
    return cfg


def _flat_keys(node: CfgNode, prefix: str = "") -> list[str]:
    keys = []
    for k, v in node.items():
        full = f"{prefix}{k}"
        keys.extend(_flat_keys(v, full + ".") if isinstance(v, CfgNode) else [full])
    return keys


def ignored_keys() -> list[str]:
    """Every key of `IGNORED`, nodes expanded to their keys, in declaration order."""
    return [
        k for k in _flat_keys(_DEFAULTS) if k in IGNORED or k.split(".")[0] in IGNORED
    ]


def unknown_key(name: str) -> str | None:
    """None when `name` is a dotted config key, else why not in words: "unknown
    config key NAME" and the closest key, e.g. " (did you mean 'VIT.HIDDEN_DIM'?)"."""
    known = _flat_keys(_DEFAULTS)
    if name in known:
        return None
    return f"unknown config key {name}{_suggest(name, known)}"


def _suggest(name: str, choices: Iterable[str]) -> str:
    choices = list(choices)
    if name.upper() in choices:  # keys are upper case: optim.base_lr
        return f" (did you mean '{name.upper()}'?)"
    close = difflib.get_close_matches(name, choices, n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _coerce(key: str, value: Any, default: Any) -> Any:
    """Returns `value` with the type of `default`, or raises ConfigError."""
    if isinstance(value, str) and not isinstance(default, str):
        # Command-line overrides arrive as strings: parse them as Python literals, or
        # else as YAML scalars, the spelling config.yaml is written in (true, null).
        try:
            value = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            with contextlib.suppress(yaml.YAMLError):
                value = yaml.safe_load(value) if value.strip() else value
    if isinstance(default, bool):
        if isinstance(value, bool):
            return value
    elif isinstance(default, int):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif isinstance(default, float):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            # YAML 1.1 reads "1e-6" (no dot) as a string: accept it as the number it is.
            try:
                return float(value)
            except ValueError:
                pass
    elif isinstance(default, (list, tuple)):
        if isinstance(value, (list, tuple)):
            return list(value)
    elif isinstance(default, str):
        if isinstance(value, str):
            return value
    elif default is None:
        return value
    want = type(default).__name__
    raise ConfigError(f"config key {key}: expected {want}, got {value!r}")


def _merge(cfg: CfgNode, src: Mapping, prefix: str = "") -> set[str]:
    """Merges the nested mapping `src` into `cfg`, checked key by key; returns the
    dotted keys it set."""
    done = set()
    for k, v in src.items():
        key = f"{prefix}{k}"
        if key in _DEPRECATED_KEYS:
            continue
        if k not in cfg:
            while isinstance(v, dict) and v:
                # An unknown section: name its first key, the closest real key to it.
                k, v = next(iter(v.items()))
                key = f"{key}.{k}"
            raise ConfigError(unknown_key(key))
        if isinstance(cfg[k], CfgNode):
            if not isinstance(v, dict):
                raise ConfigError(f"config key {key}: expected a section, got {v!r}")
            done |= _merge(cfg[k], v, key + ".")
        else:
            cfg[k] = _coerce(key, v, cfg[k])
            done.add(key)
    return done


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key given twice in one mapping (plain YAML
    keeps the last: a second `TRAIN:` section would drop the first's keys)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"{key} given twice", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep)


def read_yaml(stream) -> Any:
    """The YAML document of `stream` (text or file); yaml.YAMLError for invalid
    YAML and for a mapping key given twice (its mark at the second one)."""
    return yaml.load(stream, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader)


def merge_from_file(cfg: CfgNode, path: str) -> set[str]:
    """Merges the YAML file at `path` (and its `_BASE_` files) into the mutable `cfg`,
    checked key by key; returns the dotted keys the files set."""
    if not os.path.isfile(path):
        raise ConfigError(f"config file not found: {path}")
    try:
        with open(path) as f:
            src = read_yaml(f)
    except yaml.YAMLError as e:
        raise ConfigError(
            f"config file {path} is not valid YAML{yaml_where(e)}"
        ) from None
    if src is None:  # defaults for a config file is a mistake, not a model
        raise ConfigError(f"config file {path} is empty: it sets no key")
    if not isinstance(src, dict):
        raise ConfigError(f"config file {path} must hold a mapping of keys")
    done = set()
    if "_BASE_" in src:
        base = os.path.join(os.path.dirname(path), src.pop("_BASE_"))
        done |= merge_from_file(cfg, base)
    try:
        return done | _merge(cfg, src)
    except ConfigError as e:
        if "unknown config key" not in str(e):
            raise
        raise ConfigError(f"{e} (in {path})") from None


def yaml_where(e: yaml.YAMLError) -> str:
    """' at line L, column C: what' of a YAML error (1-based, as editors count)."""
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None) or (str(e).splitlines() or ["invalid"])[0]
    if mark is None:
        return f": {problem}"
    return f" at line {mark.line + 1}, column {mark.column + 1}: {problem}"


def _nest(key: str, value: Any) -> dict:
    node: dict = {}
    cursor = node
    parts = key.split(".")
    for p in parts[:-1]:
        cursor = cursor.setdefault(p, {})
    cursor[parts[-1]] = value
    return node


_KEY_EQUALS = re.compile(r"^([A-Za-z_][A-Za-z0-9_.]*)=(.*)$", re.S)


def override_pairs(opts: Sequence[str]) -> list[tuple[str, str]]:
    """Command-line overrides as (KEY, VALUE) pairs: `KEY VALUE` and `KEY=VALUE`
    spellings, mixed freely."""
    pairs, i = [], 0
    while i < len(opts):
        m = _KEY_EQUALS.match(opts[i])
        if m:
            pairs.append((m.group(1), m.group(2)))
            i += 1
        elif i + 1 < len(opts):
            pairs.append((opts[i], opts[i + 1]))
            i += 2
        else:
            raise ConfigError(
                f"overrides come in KEY VALUE or KEY=VALUE pairs; got {opts[i]!r} alone"
            )
    return pairs


def merge_from_list(cfg: CfgNode, opts: Sequence[str]) -> set[str]:
    """Merges command-line overrides (`KEY VALUE` or `KEY=VALUE`, values parsed as
    Python literals or YAML scalars) into the mutable `cfg`; returns the keys they
    set."""
    done = set()
    for key, value in override_pairs(opts):
        done |= _merge(cfg, _nest(key, value))
    return done


def legacy_amp_mode(cfg: CfgNode) -> str:
    """The AMP mode pycls's aliases ask for: 'O2' for FSDP.MIXED_PRECISION (with
    FSDP.ENABLED), 'O1' for TRAIN.MIXED_PRECISION, else 'fp32'. AMP.MODE '' means
    this; an AMP.MODE that is set wins over it."""
    if cfg.FSDP.ENABLED and cfg.FSDP.MIXED_PRECISION:
        return "O2"
    return "O1" if cfg.TRAIN.MIXED_PRECISION else "fp32"


def _warn_once(key: str, message: str) -> None:
    """Logs `message` once per `key` and process (only on rank 0 under torchrun)."""
    if key in _warned or os.environ.get("RANK", "0") != "0":
        return
    _warned.add(key)
    logger.warning("warning: %s", message)


_warned: set[str] = set()


def _resolve_aliases(cfg: CfgNode, explicit: set[str]) -> None:
    """Maps pycls's alias keys onto pycls_fast's one switch per concept, in place: an
    alias decides only when its switch is not in `explicit` (the keys that the file
    and the overrides set)."""
    amp = cfg.AMP
    if "AMP.MODE" not in explicit or not amp.MODE:
        amp.MODE = legacy_amp_mode(cfg)
    elif amp.MODE == "fp32" and legacy_amp_mode(cfg) != "fp32":
        alias = "FSDP" if legacy_amp_mode(cfg) == "O2" else "TRAIN"
        _warn_once(
            "AMP.MODE",
            f"AMP.MODE 'fp32' is set, so pycls's {alias}.MIXED_PRECISION True is "
            "ignored: the precision is fp32",
        )
    if "AMP.LAYER_NORM_FP32" not in explicit:
        amp.LAYER_NORM_FP32 = cfg.FSDP.LAYER_NORM_FP32
    if "FSDP.RESHARD_AFTER_FW" not in explicit:
        cfg.FSDP.RESHARD_AFTER_FW = not cfg.FSDP.DO_NOT_RESHARD_AFTER_FW
    if cfg.DATA_LOADER.MODE == "pytorch":  # pycls's name for the torch DataLoader
        cfg.DATA_LOADER.MODE = "processes"


def _get(cfg: CfgNode, key: str) -> Any:
    for part in key.split("."):
        cfg = cfg[part]
    return cfg


def refusals(key: str) -> list[str]:
    """The refused values of `key` in words (docs/CONFIG.md's limits column)."""
    return [r.doc for r in _REFUSALS if r.key == key]


def _refuse(cfg: CfgNode, at_launch: bool) -> None:
    for rule in _REFUSALS:
        if rule.at_launch == at_launch and rule.refused(cfg):
            value = _get(cfg, rule.key)
            raise ConfigError(
                f"{rule.key} {value!r} is not implemented in pycls_fast: {rule.instead}"
            )


def _warn_ignored(cfg: CfgNode) -> None:
    launch_rules = {r.key for r in _REFUSALS if r.at_launch}
    for key in ignored_keys():
        if key not in launch_rules and _get(cfg, key) != _get(_DEFAULTS, key):
            why = IGNORED.get(key) or IGNORED[key.split(".")[0]]
            _warn_once(key, f"{key} is accepted for pycls but ignored ({why})")


def check_cfg(cfg: CfgNode) -> None:
    """Checks each key against its limits, the combinations of keys and the refused
    values; raises ConfigError with one line naming the first bad key."""
    for key, limit in LIMITS.items():
        if message := limit.error(key, _get(cfg, key)):
            raise ConfigError(message)
    _refuse(cfg, at_launch=False)
    _check_vit(cfg.VIT, cfg.TRAIN.IM_SIZE)
    _check_attention(cfg)
    if cfg.OPTIM.LR_POLICY == "steps" and not cfg.OPTIM.STEPS:
        raise ConfigError("OPTIM.STEPS must be set when OPTIM.LR_POLICY is 'steps'")
    _check_parallel(cfg)
    _check_fp8(cfg)
    _check_optimizer(cfg)
    # Batches are split among the data-parallel ranks (NUM_GPUS without TP or PP).
    dp = cfg.NUM_GPUS // (cfg.PARALLEL.TP * cfg.PARALLEL.PP)
    ranks = f"NUM_GPUS ({cfg.NUM_GPUS})" if dp == cfg.NUM_GPUS else f"DP ({dp})"
    for key in ("TRAIN.BATCH_SIZE", "TEST.BATCH_SIZE"):
        if _get(cfg, key) % dp:
            raise ConfigError(f"{key} ({_get(cfg, key)}) must be divisible by {ranks}")
    _check_distill(cfg)
    _check_cuda_graphs(cfg)
    _check_accept_changes(cfg.TRAIN.ACCEPT_CHANGES)
    if cfg.TRAIN.BCE_BINARY_TARGETS and cfg.TRAIN.BCE_TARGET_THRESH:
        raise ConfigError(
            "TRAIN.BCE_BINARY_TARGETS True is the threshold 0: leave "
            "TRAIN.BCE_TARGET_THRESH at 0"
        )
    for size in cfg.TEST.SIZES:
        if not isinstance(size, int) or size <= 0 or size % cfg.VIT.PATCH_SIZE:
            raise ConfigError(
                f"TEST.SIZES: {size!r} is not a positive multiple of VIT.PATCH_SIZE "
                f"({cfg.VIT.PATCH_SIZE})"
            )
    _check_size_schedule(cfg, dp)
    per_rank = cfg.TRAIN.BATCH_SIZE // dp
    if per_rank % cfg.TRAIN.ACCUM_STEPS:
        raise ConfigError(
            f"TRAIN.ACCUM_STEPS ({cfg.TRAIN.ACCUM_STEPS}) must divide each process's "
            f"batch (TRAIN.BATCH_SIZE / {ranks.split(' ')[0]} = {per_rank})"
        )


# Built with torch's own classes (components/optimizer.py); any other OPTIM.OPTIMIZER
# goes through timm's optimizer factory.
TORCH_OPTIMIZERS = ("sgd", "adam", "adamw")


def _check_optimizer(cfg: CfgNode) -> None:
    name = cfg.OPTIM.OPTIMIZER
    if name in TORCH_OPTIMIZERS:
        return
    from timm.optim import list_optimizers

    timm_names = list_optimizers()
    if name not in timm_names:
        hint = _suggest(name, [*TORCH_OPTIMIZERS, *timm_names])
        raise ConfigError(
            f"OPTIM.OPTIMIZER must be 'sgd', 'adam', 'adamw' or one of timm's "
            f"optimizers (timm.optim.list_optimizers()), got {name!r}{hint}"
        )


def train_stage(cfg: CfgNode, epoch: int) -> tuple[int, int]:
    """(image size, global batch size) of training at `epoch` (0-based): the
    TRAIN.SIZE_SCHEDULE stage it falls in, else (TRAIN.IM_SIZE, TRAIN.BATCH_SIZE)."""
    size, batch = cfg.TRAIN.IM_SIZE, cfg.TRAIN.BATCH_SIZE
    for first, stage_size, stage_batch in cfg.TRAIN.SIZE_SCHEDULE:
        if epoch >= first:
            size, batch = stage_size, stage_batch
    return int(size), int(batch)


def _check_size_schedule(cfg: CfgNode, dp: int) -> None:
    stages = cfg.TRAIN.SIZE_SCHEDULE
    if not stages:
        return
    key = "TRAIN.SIZE_SCHEDULE"
    shaped = all(
        isinstance(s, (list, tuple))
        and len(s) == 3
        and all(isinstance(v, int) for v in s)
        for s in stages
    )
    if not shaped:
        raise ConfigError(
            f"{key}: each stage is [first epoch, size, batch], got {stages}"
        )
    firsts = [s[0] for s in stages]
    if firsts[0] != 0 or firsts != sorted(set(firsts)):
        raise ConfigError(
            f"{key}: first epochs must start at 0 and increase, got {firsts}"
        )
    if stages[-1][1] != cfg.TRAIN.IM_SIZE:
        raise ConfigError(
            f"{key}: the last stage's size ({stages[-1][1]}) must be TRAIN.IM_SIZE "
            f"({cfg.TRAIN.IM_SIZE}), the size the model is built at"
        )
    if cfg.PARALLEL.TP > 1 or cfg.PARALLEL.PP > 1:
        raise ConfigError(f"{key} works with data parallelism only (PARALLEL.TP/PP 1)")
    for _, size, batch in stages:
        if size <= 0 or size % cfg.VIT.PATCH_SIZE:
            raise ConfigError(
                f"{key}: size {size} is not a positive multiple of VIT.PATCH_SIZE "
                f"({cfg.VIT.PATCH_SIZE})"
            )
        if batch <= 0 or batch % (dp * cfg.TRAIN.ACCUM_STEPS):
            raise ConfigError(
                f"{key}: batch {batch} must divide into {dp} data-parallel ranks x "
                f"TRAIN.ACCUM_STEPS ({cfg.TRAIN.ACCUM_STEPS})"
            )


def pp_microbatches(cfg: CfgNode) -> int:
    """PARALLEL.PP_MICROBATCHES, its 0 resolved to 2 x PP."""
    return cfg.PARALLEL.PP_MICROBATCHES or 2 * cfg.PARALLEL.PP


def _check_parallel(cfg: CfgNode) -> None:
    """NUM_GPUS = PP x DP x TP; the heads, widths and layers split evenly."""
    tp, pp, vit = cfg.PARALLEL.TP, cfg.PARALLEL.PP, cfg.VIT
    if cfg.NUM_GPUS % (tp * pp):
        raise ConfigError(
            f"NUM_GPUS ({cfg.NUM_GPUS}) must be a multiple of PARALLEL.TP x "
            f"PARALLEL.PP ({tp} x {pp}): NUM_GPUS = PP x DP x TP"
        )
    for key, value in (("NUM_HEADS", vit.NUM_HEADS), ("MLP_DIM", vit.MLP_DIM)):
        if value % tp:
            raise ConfigError(
                f"VIT.{key} ({value}) must be divisible by PARALLEL.TP ({tp})"
            )
    dp = cfg.NUM_GPUS // (tp * pp)
    if tp > 1 and dp > 1 and not cfg.FSDP.ENABLED:
        raise ConfigError(
            f"PARALLEL.TP {tp} with {dp} data-parallel ranks needs FSDP.ENABLED True "
            "(DDP does not take tensor-parallel parameters)"
        )
    amp = cfg.AMP.MODE or legacy_amp_mode(cfg)
    if (tp > 1 or pp > 1) and amp == "O2" and not cfg.FSDP.ENABLED:
        raise ConfigError(
            "AMP.MODE O2 with PARALLEL.TP or PARALLEL.PP > 1 needs FSDP.ENABLED True "
            "(FSDP's fp32 shards are the master weights that sharded checkpoints save)"
        )
    stages = pp * (2 if cfg.PARALLEL.PP_SCHEDULE == "interleaved" and pp > 1 else 1)
    if stages > vit.NUM_LAYERS:
        raise ConfigError(
            f"VIT.NUM_LAYERS ({vit.NUM_LAYERS}) must be at least the {stages} "
            "pipeline stages (PARALLEL.PP, two per rank when interleaved)"
        )
    if pp > 1:
        per_dp, n = cfg.TRAIN.BATCH_SIZE // dp, pp_microbatches(cfg)
        if cfg.TRAIN.BATCH_SIZE % dp or per_dp % n:
            raise ConfigError(
                f"TRAIN.BATCH_SIZE ({cfg.TRAIN.BATCH_SIZE}) must split into {dp} "
                f"data-parallel ranks x {n} pipeline micro-batches "
                "(PARALLEL.PP_MICROBATCHES)"
            )
        if cfg.PARALLEL.PP_SCHEDULE != "gpipe" and n < pp:
            raise ConfigError(
                f"PARALLEL.PP_MICROBATCHES ({n}) must be at least PARALLEL.PP ({pp}) "
                f"for the {cfg.PARALLEL.PP_SCHEDULE} schedule"
            )
        if cfg.PARALLEL.PP_SCHEDULE == "interleaved" and n % pp:
            # torch's interleaved schedule runs micro-batches in rounds of PP.
            raise ConfigError(
                f"PARALLEL.PP_MICROBATCHES ({n}) must be a multiple of PARALLEL.PP "
                f"({pp}) for the interleaved schedule"
            )
        for key, on in (
            ("BN.USE_PRECISE_STATS", cfg.BN.USE_PRECISE_STATS),
            ("DISTILL.TYPE", cfg.DISTILL.TYPE != "none"),
            ("TRAIN.ACCUM_STEPS", cfg.TRAIN.ACCUM_STEPS > 1),
        ):
            if on:
                raise ConfigError(
                    f"{key} is not supported with PARALLEL.PP > 1 (the pipeline's "
                    "micro-batches already accumulate gradients)"
                    if key == "TRAIN.ACCUM_STEPS"
                    else f"{key} is not supported with PARALLEL.PP > 1"
                )


def _check_fp8(cfg: CfgNode) -> None:
    """AMP.FP8 with bf16 only (torchao's float8 training is made and tested for
    bf16, as torchtitan runs it; fp16's loss scaling is not part of its recipes) and
    float8 dims: torch's float8 matmul takes dims that are multiples of 16, and each
    tensor-parallel rank multiplies its own slice."""
    if not cfg.AMP.FP8:
        return
    amp = cfg.AMP.MODE or legacy_amp_mode(cfg)
    if cfg.AMP.DTYPE == "fp16" and amp != "fp32":
        raise ConfigError(
            "AMP.FP8 True needs AMP.DTYPE bf16 (torchao's float8 training has no "
            "fp16 recipe), got fp16"
        )
    tp = cfg.PARALLEL.TP
    for key in ("HIDDEN_DIM", "MLP_DIM"):
        value = cfg.VIT[key]
        if value % (16 * tp):
            per_rank = f" / PARALLEL.TP ({tp}) = {value / tp:g}" if tp > 1 else ""
            raise ConfigError(
                f"AMP.FP8 True needs VIT.{key} ({value}){per_rank} to be a multiple "
                "of 16 (float8 matmul dims)"
            )


def _check_cuda_graphs(cfg: CfgNode) -> None:
    """TRAIN.CUDA_GRAPHS: the whole model in one compiled graph, nothing that runs
    host code between its kernels."""
    if not cfg.TRAIN.CUDA_GRAPHS:
        return
    dp = cfg.NUM_GPUS // (cfg.PARALLEL.TP * cfg.PARALLEL.PP)
    for key, on in (
        ("FSDP.ENABLED", cfg.FSDP.ENABLED and dp > 1),
        ("PARALLEL.TP", cfg.PARALLEL.TP > 1),
        ("PARALLEL.PP", cfg.PARALLEL.PP > 1),
        ("TRAIN.COMPILE 'block'", cfg.TRAIN.COMPILE == "block"),
    ):
        if on:
            raise ConfigError(
                f"TRAIN.CUDA_GRAPHS True does not work with {key}: CUDA graphs "
                "replay the whole model's kernels (one GPU or DDP, TRAIN.COMPILE "
                "'model' or 'off')"
            )


def _check_accept_changes(value: str) -> None:
    """Every name in TRAIN.ACCEPT_CHANGES is a config key (or 'all')."""
    known = _flat_keys(_DEFAULTS)
    for name in (k.strip() for k in value.split(",")):
        if name and name != "all" and name not in known:
            raise ConfigError(
                f"TRAIN.ACCEPT_CHANGES: {name!r} is not a config key"
                f"{_suggest(name, known)}"
            )


def _check_distill(cfg: CfgNode) -> None:
    """Distillation needs a teacher; the distillation token needs distillation (its
    head learns from the teacher) and the class token."""
    d = cfg.DISTILL
    if d.TYPE != "none" and not (d.TEACHER_CFG and d.TEACHER_WEIGHTS):
        raise ConfigError(
            f"DISTILL.TYPE {d.TYPE} needs DISTILL.TEACHER_CFG and "
            "DISTILL.TEACHER_WEIGHTS (the teacher's config and weights)"
        )
    if cfg.VIT.DISTILL_TOKEN and d.TYPE == "none":
        raise ConfigError("VIT.DISTILL_TOKEN True needs DISTILL.TYPE soft or hard")
    if cfg.VIT.DISTILL_TOKEN and cfg.VIT.CLASSIFIER_TYPE != "token":
        raise ConfigError("VIT.DISTILL_TOKEN True needs VIT.CLASSIFIER_TYPE token")


def check_launch(cfg: CfgNode) -> None:
    """Refuses, with a ConfigError naming the key, a config whose launch keys ask for
    what pycls_fast does not implement, or a job that cannot be laid out on nodes;
    the tools call it (also via launch/processes.py) before any work starts."""
    _refuse(cfg, at_launch=True)
    per_node = cfg.MAX_GPUS_PER_NODE
    if (
        cfg.LAUNCH.MODE != "local"
        and per_node < cfg.NUM_GPUS
        and cfg.NUM_GPUS % per_node
    ):
        raise ConfigError(
            f"NUM_GPUS ({cfg.NUM_GPUS}) over several nodes must be a multiple of "
            f"MAX_GPUS_PER_NODE ({per_node})"
        )


def _check_attention(cfg: CfgNode) -> None:
    """Refuses a half-precision-only attention kernel in an fp32 run (it would fail
    at the first step on a GPU: "No available kernel")."""
    kernel = cfg.VIT.ATTENTION
    if kernel in ATTENTION_NEEDS_HALF and (cfg.AMP.MODE or legacy_amp_mode(cfg)) == (
        "fp32"
    ):
        raise ConfigError(
            f"VIT.ATTENTION {kernel!r} needs fp16 / bf16 inputs, but AMP.MODE is "
            "'fp32': set AMP.MODE O1, O2 or O3, or VIT.ATTENTION 'sdpa' or 'auto'"
        )


def _check_vit(vit: CfgNode, im_size: int) -> None:
    if im_size % vit.PATCH_SIZE:
        raise ConfigError(
            f"TRAIN.IM_SIZE ({im_size}) must be divisible by VIT.PATCH_SIZE "
            f"({vit.PATCH_SIZE})"
        )
    if vit.HIDDEN_DIM % vit.NUM_HEADS:
        raise ConfigError(
            f"VIT.HIDDEN_DIM ({vit.HIDDEN_DIM}) must be divisible by VIT.NUM_HEADS "
            f"({vit.NUM_HEADS})"
        )
    if vit.STEM_TYPE != "conv":
        return
    ks, ss, ws = vit.C_STEM_KERNELS, vit.C_STEM_STRIDES, vit.C_STEM_DIMS
    if not ks or not len(ks) == len(ss) == len(ws):
        raise ConfigError(
            "VIT.C_STEM_KERNELS, VIT.C_STEM_STRIDES and VIT.C_STEM_DIMS must be "
            f"non-empty and of equal length, got {len(ks)}, {len(ss)}, {len(ws)}"
        )
    if any(k % 2 == 0 or k < 1 for k in ks):
        raise ConfigError(f"VIT.C_STEM_KERNELS must be odd, got {list(ks)}")
    prod = 1
    for s in ss:
        prod *= s
    if prod != vit.PATCH_SIZE:
        raise ConfigError(
            f"VIT.C_STEM_STRIDES {list(ss)} multiply to {prod}, not VIT.PATCH_SIZE "
            f"({vit.PATCH_SIZE})"
        )
    if ws[-1] != vit.HIDDEN_DIM:
        raise ConfigError(
            f"VIT.C_STEM_DIMS ends with {ws[-1]}, not VIT.HIDDEN_DIM ({vit.HIDDEN_DIM})"
        )


def _finish(cfg: CfgNode, explicit: set[str]) -> CfgNode:
    """Resolves the aliases, checks, warns about ignored keys and freezes `cfg`."""
    _resolve_aliases(cfg, explicit)
    check_cfg(cfg)
    _warn_ignored(cfg)
    cfg.__dict__[_EXPLICIT] = frozenset(explicit)
    cfg.freeze()
    return cfg


def load_cfg(
    path: str | None = None, opts: Sequence[str] = (), world_size: int | None = None
) -> CfgNode:
    """Returns the default config merged with the file at `path` and the `KEY VALUE`
    overrides `opts`, with pycls's aliases resolved, checked and frozen.

    `world_size`: the processes a launcher started (torchrun's or SLURM's
    WORLD_SIZE, known to the launch layer). It wins over the config's NUM_GPUS
    (one log line says so when the config set another value), before the checks
    that depend on the number of ranks (batch splits, PP x DP x TP) run.

    Raises ConfigError (a ValueError) with one line naming the bad key or file.
    """
    cfg = get_cfg()
    explicit = merge_from_file(cfg, path) if path else set()
    explicit |= merge_from_list(cfg, list(opts))
    if world_size is not None:
        explicit |= use_world_size(cfg, explicit, world_size)
    return _finish(cfg, explicit)


def use_world_size(cfg: CfgNode, explicit: set[str], world_size: int) -> set[str]:
    """Sets NUM_GPUS of the unfrozen `cfg` to the launcher's `world_size`, with one
    log line (rank 0) when the config had set another value; returns the keys set."""
    if "NUM_GPUS" in explicit and world_size != cfg.NUM_GPUS:
        _warn_once(
            "NUM_GPUS",
            f"NUM_GPUS {cfg.NUM_GPUS} of the config is replaced by the launcher's "
            f"world size, {world_size} processes (torchrun / SLURM); batch sizes "
            "are global and split over them",
        )
    cfg.NUM_GPUS = world_size
    return {"NUM_GPUS"}


def load_cfg_text(text: str, opts: Sequence[str] = ()) -> CfgNode:
    """`load_cfg` of a config held as YAML text (a checkpoint's saved `cfg`)."""
    try:
        src = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"saved config is not valid YAML: {e}") from None
    if not isinstance(src, dict):
        raise ConfigError("a saved config must hold a mapping of keys")
    cfg = get_cfg()
    explicit = _merge(cfg, src)
    explicit |= merge_from_list(cfg, list(opts))
    return _finish(cfg, explicit)


def with_overrides(cfg: CfgNode, overrides: Mapping[str, Any]) -> CfgNode:
    """Returns a new frozen, checked config: `cfg` with `overrides` ({dotted key:
    value}) applied as if they had followed its overrides on the command line (the
    same merge, alias rule and checks). `cfg` itself is left as it is.

    This is the one way to adjust a loaded config (tools, the launcher, tests).
    """
    new = cfg.clone()
    new.defrost()
    explicit = set(cfg.__dict__.get(_EXPLICIT, ()))
    for key, value in overrides.items():
        explicit |= _merge(new, _nest(key, value))
    return _finish(new, explicit)


def dump_cfg(cfg: CfgNode, out_dir: str | None = None) -> str:
    """Writes `cfg` to OUT_DIR/CFG_DEST (atomically) and returns the path."""
    out_dir = out_dir or cfg.OUT_DIR
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, cfg.CFG_DEST)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(cfg.dump())
    os.replace(tmp, path)
    return path
