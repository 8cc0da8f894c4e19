"""Pipeline parallelism (PARALLEL.PP) with torch.distributed.pipelining.

    bounds = stage_bounds(cfg, n_stages)            # blocks of each stage, by cost
    stages = split_model(model, cfg, pp_rank)       # [(stage index, pruned copy)]
    union = stage_union([m for _, m in stages])     # the rank's parameters, one module
    runner = PipelineRunner(stages, cfg, pp_group, device)
    loss, logits = runner.train(x, y, loss_fn)      # a step's forward and backward
    logits = runner.evaluate(x, size)               # forward only (None before last)

A stage is a copy of the ViT with the other stages' parts set to None (torchtitan's
way; ViT.forward runs the parts it holds), so its parameter names are the whole
model's and checkpoints reshard between layouts. The encoder is split into
contiguous blocks of balanced cost (`complexity` flops), the stem, tokens and
position embedding with the first stage, the final LayerNorm and head with the last.
Schedules: GPipe (all forwards, then all backwards), 1F1B (PipeDream-flush: at most
PP micro-batches in flight) and interleaved 1F1B (two stages per rank: stage indices
r and r + PP on rank r, half the bubble). The loss runs on the last stage, per
micro-batch, as the mean over the micro-batch; the schedule divides the gradients
by the number of micro-batches (`scale_grads`), so they are the whole batch's mean.
"""

import copy
import functools

import torch
from torch import nn
from yacs.config import CfgNode

from pycls_fast.config import pp_microbatches
from pycls_fast.models.blocks import layernorm_cx
from pycls_fast.models.vit import (
    ViT,
    ViTEncoder,
    ViTEncoderBlock,
    ViTHead,
    ViTParams,
    ViTStemConv,
    ViTStemPatchify,
)


def stages_per_rank(cfg: CfgNode, pp: int | None = None) -> int:
    """Two stages per rank under the interleaved schedule, else one; `pp`: the
    pipeline's size when not cfg.PARALLEL.PP (a layout the planner weighs)."""
    pp = cfg.PARALLEL.PP if pp is None else pp
    return 2 if cfg.PARALLEL.PP_SCHEDULE == "interleaved" and pp > 1 else 1


def _costs(cfg: CfgNode) -> tuple[float, list[float], float]:
    """Forward flops of (stem with tokens, each block, final LayerNorm with head)."""
    p = ViTParams.from_cfg(cfg)
    cx0 = {"h": p.image_size, "w": p.image_size, "flops": 0, "params": 0, "acts": 0}
    if p.stem_type == "patchify":
        stem = ViTStemPatchify.complexity(dict(cx0), 3, p.hidden_d, p.patch_size)
    else:
        ks, ws, ss = p.c_stem_kernels, p.c_stem_dims, p.c_stem_strides
        stem = ViTStemConv.complexity(dict(cx0), 3, ks, ws, ss)
    block = ViTEncoderBlock.complexity(
        dict(cx0), p.hidden_d, p.n_heads, p.mlp_d, p.seq_len, p.layer_scale > 0
    )
    head = layernorm_cx(dict(cx0), p.hidden_d)
    head = ViTHead.complexity(head, p.hidden_d, p.num_classes)
    heads = 2 if p.distill_token else 1
    return stem["flops"], [block["flops"]] * p.n_layers, head["flops"] * heads


def stage_bounds(cfg: CfgNode, n_stages: int) -> list[tuple[int, int]]:
    """[start, end) encoder blocks of each of `n_stages` stages: contiguous, at
    least one each, minimizing the most expensive stage (stem counted with the
    first, head with the last)."""
    stem, blocks, head = _costs(cfg)
    return list(_balanced_bounds(stem, tuple(blocks), head, n_stages))


@functools.cache
def _balanced_bounds(
    stem: float, blocks: tuple[float, ...], head: float, n_stages: int
) -> tuple[tuple[int, int], ...]:
    """`stage_bounds` of the costs (a dynamic program of n_stages x blocks^2 steps,
    asked again for every layout the planner weighs: kept)."""
    n = len(blocks)
    if not 1 <= n_stages <= n:
        raise ValueError(f"{n_stages} stages for {n} blocks")
    prefix = [0.0]
    for b in blocks:
        prefix.append(prefix[-1] + b)

    def cost(s, i, j):  # stage s holding blocks [i, j)
        c = prefix[j] - prefix[i]
        return c + (stem if s == 0 else 0) + (head if s == n_stages - 1 else 0)

    # best[s][j]: the lowest possible maximum stage cost of blocks [0, j) in s + 1
    # stages; cut[s][j]: where its last stage starts.
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(n_stages)]
    cut = [[0] * (n + 1) for _ in range(n_stages)]
    for j in range(1, n + 1):
        best[0][j] = cost(0, 0, j)
    for s in range(1, n_stages):
        for j in range(s + 1, n + 1):
            for i in range(s, j):
                value = max(best[s - 1][i], cost(s, i, j))
                if value < best[s][j]:
                    best[s][j], cut[s][j] = value, i
    bounds, end = [], n
    for s in range(n_stages - 1, -1, -1):
        start = cut[s][end] if s else 0
        bounds.append((start, end))
        end = start
    return tuple(bounds[::-1])


def rank_stage_indices(cfg: CfgNode, pp_rank: int) -> list[int]:
    """Stage indices that pipeline rank `pp_rank` runs (rank r: r, then r + PP)."""
    pp = cfg.PARALLEL.PP
    return [pp_rank + v * pp for v in range(stages_per_rank(cfg))]


def _prune(model: ViT, first: bool, last: bool, blocks: range) -> ViT:
    """`model` (in place) holding only the parts of one stage."""
    if not first:
        model.stem = None
        for name in ("class_token", "dist_token", "pos_embedding"):
            if getattr(model, name, None) is not None:
                delattr(model, name)
                model.register_parameter(name, None)
    if not last:
        model.head = None
        model.head_dist = None
        model.encoder.ln = None
    for name in list(model.encoder._modules):
        if name.startswith("block_") and int(name[6:]) not in blocks:
            del model.encoder._modules[name]
    return model


def split_model(model: ViT, cfg: CfgNode, pp_rank: int) -> list[tuple[int, ViT]]:
    """The stages rank `pp_rank` runs: [(stage index, the model pruned to it)].
    `model` itself becomes the last of them (the others are copies)."""
    n_stages = cfg.PARALLEL.PP * stages_per_rank(cfg)
    bounds = stage_bounds(cfg, n_stages)
    indices = rank_stage_indices(cfg, pp_rank)
    out = []
    for k, index in enumerate(indices):
        m = model if k == len(indices) - 1 else copy.deepcopy(model)
        start, end = bounds[index]
        first, last = index == 0, index == n_stages - 1
        out.append((index, _prune(m, first, last, range(start, end))))
    return out


def stage_union(modules: list[ViT]) -> ViT:
    """One module holding the parameters of all `modules` (a rank's stages) under
    the whole model's names, for the optimizer, the EMA update and checkpoints (it
    is never called). Its parameters and submodules are the stages' own objects:
    build it after the stages are sharded or split."""
    if len(modules) == 1:
        return modules[0]
    union = ViT.__new__(ViT)
    nn.Module.__init__(union)
    union.params, union.batch_first = modules[0].params, modules[0].batch_first
    encoder = ViTEncoder.__new__(ViTEncoder)
    nn.Module.__init__(encoder)
    for m in modules:
        for name, param in m._parameters.items():
            if param is not None:
                union.register_parameter(name, param)
        for name, child in m._modules.items():
            if name != "encoder" and child is not None:
                union.add_module(name, child)
        for name, child in m.encoder._modules.items():
            if child is not None:
                encoder.add_module(name, child)
    union.add_module("encoder", encoder)
    return union


class PipelineRunner:
    """A rank's stages under the configured schedule: one for training steps (its
    micro-batch shapes inferred at the first step; the batch size is fixed) and one
    per evaluation batch size (partial batches are padded to whole ones)."""

    def __init__(
        self,
        modules: list[tuple[int, nn.Module]],
        cfg: CfgNode,
        group,
        device: torch.device,
        train: bool = True,
    ) -> None:
        self.cfg, self.group, self.device = cfg, group, device
        self.n_stages = cfg.PARALLEL.PP * stages_per_rank(cfg)
        self.indices = [i for i, _ in modules]
        self.modules = [m for _, m in modules]
        self.is_first = 0 in self.indices
        self.is_last = self.n_stages - 1 in self.indices
        self.n_micro = pp_microbatches(cfg)
        self._loss_fn = None
        # stage index -> PipelineStage keyword arguments of its static shapes.
        self._static = None
        self._train = self._schedule(self._loss) if train else None
        # One schedule per padded batch size: a stage infers its activations'
        # shapes at its first call and keeps them.
        self._eval = {}

    def _loss(self, output, target):
        return self._loss_fn(output, target)

    def set_static_shapes(self, shapes) -> None:
        """Gives the training schedule's stages their example input and output
        tensors instead of inferring them at the first step (which a fake process
        group cannot: engine/dry_run.py). `shapes(stage index)`: PipelineStage's
        input_args, output_args, input_grads, output_grads."""
        self._static = shapes
        self._train = self._schedule(self._loss)

    def _schedule(self, loss_fn):
        from torch.distributed import pipelining as pl

        stages = [
            pl.PipelineStage(
                m,
                i,
                self.n_stages,
                self.device,
                group=self.group,
                **(self._static(i) if self._static and loss_fn else {}),
            )
            for i, m in zip(self.indices, self.modules)
        ]
        kind = self.cfg.PARALLEL.PP_SCHEDULE
        if kind == "interleaved":
            return pl.ScheduleInterleaved1F1B(stages, self.n_micro, loss_fn=loss_fn)
        cls = pl.ScheduleGPipe if kind == "gpipe" else pl.Schedule1F1B
        return cls(stages[0], self.n_micro, loss_fn=loss_fn)

    def train(self, inputs, targets, loss_fn):
        """Forward and backward of one batch in PARALLEL.PP_MICROBATCHES micro-batches.
        `loss_fn(logits, targets)`: a micro-batch's loss, as backpropagated. Returns
        (the losses' mean, detached, logits (B, classes)) on the last stage, else
        (None, None)."""
        self._loss_fn = loss_fn
        losses = []
        args = (inputs,) if self.is_first else ()
        target = targets if self.is_last else None
        out = self._train.step(*args, target=target, losses=losses)
        if not self.is_last:
            return None, None
        return torch.stack([x.detach() for x in losses]).mean(), out.detach()

    def evaluate(self, inputs, size: int):
        """Logits (n, classes) of `inputs` (n <= `size` images, padded to `size`
        rounded up to whole micro-batches) on the last stage, else None; every rank
        of the pipeline calls it with the same batch."""
        size = -(-size // self.n_micro) * self.n_micro
        if size not in self._eval:
            self._eval[size] = self._schedule(None)
        args = ()
        n = len(inputs)
        if self.is_first:
            if n < size:
                pad = inputs.new_zeros((size - n, *inputs.shape[1:]))
                inputs = torch.cat([inputs, pad])
            args = (inputs,)
        with torch.no_grad():
            out = self._eval[size].eval(*args)
        return out[:n] if self.is_last else None
