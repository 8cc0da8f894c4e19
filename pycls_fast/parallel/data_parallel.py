"""Parallelism applied from outside the model (the model file knows nothing of it).

    model = parallelize(model, cfg, mode, half, device)
    # or, on a model built on the meta device (parallel/materialize.py):
    shard(model, cfg, mode, half); materialize(...); wrap_data_parallel(model, ...)

- one process: the model as it is;
- several processes, FSDP.ENABLED False: DistributedDataParallel;
- FSDP.ENABLED True: torch's FSDP2 `fully_shard`, per encoder block, then the root
  (at any world size, one included, so that its sharded checkpoints are one format).
FSDP.ACTIVATION_CHECKPOINT recomputes each encoder block's activations in backward,
with or without FSDP.

How the AMP modes map to FSDP (`fsdp_mixed_precision`): O2 keeps the sharded
parameters in fp32 (they are the master weights, so no separate master copy exists)
and all-gathers them in half precision for compute, reducing gradients in fp32; O3
shards half-precision parameters and reduces in half precision; fp32 and O1 shard fp32
parameters (autocast does O1's casts). AMP.LAYER_NORM_FP32 (which pycls's
FSDP.LAYER_NORM_FP32 maps onto) keeps LayerNorm (and the conv stem's BatchNorm)
parameters in fp32 for compute under O2.
"""

import warnings
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from yacs.config import CfgNode

from pycls_fast.components.precision import AmpMode
from pycls_fast.models.vit import ViTEncoderBlock
from pycls_fast.runtime import distributed

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy

_NORMS = (nn.LayerNorm, nn.BatchNorm2d)


def encoder_blocks(model: nn.Module) -> list[ViTEncoderBlock]:
    """The units that FSDP shards and activation checkpointing recomputes."""
    return [m for m in model.modules() if isinstance(m, ViTEncoderBlock)]


def fsdp_enabled(cfg: CfgNode) -> bool:
    return cfg.FSDP.ENABLED


def sharded_checkpoints(cfg: CfgNode) -> bool:
    """Whether checkpoints are DCP directories that every rank writes its part of:
    under FSDP, tensor or pipeline parallelism (no rank holds the whole model)."""
    return cfg.FSDP.ENABLED or cfg.PARALLEL.TP > 1 or cfg.PARALLEL.PP > 1


def reshard_after_forward(cfg: CfgNode) -> bool:
    """FSDP.RESHARD_AFTER_FW (a loaded config has pycls's DO_NOT_RESHARD_AFTER_FW
    resolved onto it)."""
    return cfg.FSDP.RESHARD_AFTER_FW


def fsdp_mixed_precision(mode: AmpMode, half: torch.dtype) -> "MixedPrecisionPolicy":
    """FSDP2's MixedPrecisionPolicy for an AMP mode (see the module docstring)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if mode is AmpMode.O2:
        return MixedPrecisionPolicy(param_dtype=half, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def apply_activation_checkpointing(model: nn.Module) -> nn.Module:
    """Recomputes each encoder block's forward in backward (names unchanged)."""
    from torch.distributed._composable import checkpoint

    for block in encoder_blocks(model):
        checkpoint(block)
    return model


def shard_model(
    model: nn.Module, cfg: CfgNode, mode: AmpMode, half: torch.dtype, mesh=None
) -> nn.Module:
    """Applies fully_shard per encoder block, then to the root (in place), over
    `mesh` (the 'dp' dimension of a model-parallel mesh; None: all ranks)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = fsdp_mixed_precision(mode, half)
    kw = {"reshard_after_forward": reshard_after_forward(cfg), "mesh": mesh}
    if mode is AmpMode.O2 and cfg.AMP.LAYER_NORM_FP32:
        # All the norms are one FSDP unit gathered in fp32, not a unit each: every
        # unit costs its own hooks, all-gather and reduce-scatter each step, which on
        # a GPU made O2 slower than O1 (docs/PERFORMANCE.md, "First measurements on
        # a GPU"). The norms' weights are a few KB a block.
        norms = [m for m in model.modules() if isinstance(m, _NORMS)]
        if norms:
            fp32 = MixedPrecisionPolicy(param_dtype=torch.float32)
            fully_shard(norms, mp_policy=fp32, **kw)
    for block in encoder_blocks(model):
        fully_shard(block, mp_policy=policy, **kw)
    fully_shard(model, mp_policy=policy, **kw)
    return model


def _fp32_allreduce_hook(group, bucket):
    """DDP comm hook: averages half-precision gradients in fp32 (AMP O2's grads are
    half precision; summing them in half precision loses bits at many ranks)."""
    grads = bucket.buffer()
    total = grads.float().div_(dist.get_world_size(group))
    fut = dist.all_reduce(total, group=group, async_op=True).get_future()

    def copy_back(f):
        grads.copy_(f.value()[0])
        return grads

    return fut.then(copy_back)


def wrap_ddp(
    model: nn.Module, mode: AmpMode, device: torch.device, group=None
) -> DistributedDataParallel:
    """DistributedDataParallel over this process's device, among `group` (None: all
    ranks)."""
    ids = [device.index] if device.type == "cuda" else None
    # pos_embedding (1, seq, hidden) gets its gradient with another stride on its
    # size-1 dim; DDP compares all strides and warns on every step about a copy of a
    # few KB. Nothing to fix there.
    warnings.filterwarnings("ignore", message="Grad strides do not match bucket view")
    # Gradients as views of the communication buckets: no copy in and out of them.
    ddp = DistributedDataParallel(
        model, device_ids=ids, gradient_as_bucket_view=True, process_group=group
    )
    if mode is AmpMode.O2:
        ddp.register_comm_hook(group, _fp32_allreduce_hook)
    return ddp


def shard(
    model: nn.Module,
    cfg: CfgNode,
    mode: AmpMode,
    half: torch.dtype,
    dp_mesh=None,
) -> nn.Module:
    """Activation checkpointing, compile, then FSDP if enabled: what applies to
    `model` before its tensors hold values (on the meta device; or on its device,
    already split by tensor parallelism if any), in place; returns it. `dp_mesh`:
    the data-parallel ranks of a model-parallel mesh (None: all ranks)."""
    if cfg.FSDP.ACTIVATION_CHECKPOINT:
        apply_activation_checkpointing(model)
    if cfg.TRAIN.CUDA_GRAPHS:
        apply_compile(model, "model", mode="reduce-overhead")
    else:
        apply_compile(model, cfg.TRAIN.COMPILE)
    if fsdp_enabled(cfg):
        shard_model(model, cfg, mode, half, dp_mesh)
    return model


def wrap_data_parallel(
    model: nn.Module,
    cfg: CfgNode,
    mode: AmpMode,
    device: torch.device,
    dp_mesh=None,
) -> nn.Module:
    """The module to train after `shard` and materialization: a DDP wrapper when
    several data-parallel ranks replicate `model` (no FSDP), else `model` itself
    (DDP broadcasts rank 0's values at construction: they must exist)."""
    if fsdp_enabled(cfg):
        return model
    data_parallel = dp_mesh.size() if dp_mesh is not None else distributed.world_size()
    if data_parallel > 1:
        group = dp_mesh.get_group() if dp_mesh is not None else None
        return wrap_ddp(model, mode, device, group)
    return model


def parallelize(
    model: nn.Module,
    cfg: CfgNode,
    mode: AmpMode,
    half: torch.dtype,
    device: torch.device,
    dp_mesh=None,
) -> nn.Module:
    """`shard` then `wrap_data_parallel` of a model whose tensors hold values: the
    module to train, `model` itself (one process, or sharded in place by FSDP) or a
    DDP wrapper around it. `model` is on `device`, prepared for `mode` (for FSDP
    O2: still fp32, see the module docstring), already split by tensor parallelism
    if any."""
    shard(model, cfg, mode, half, dp_mesh)
    return wrap_data_parallel(model, cfg, mode, device, dp_mesh)


def apply_compile(model: nn.Module, how: str, mode: str | None = None) -> nn.Module:
    """TRAIN.COMPILE: torch.compile each encoder block ('block') or the whole model
    ('model'), in place (`Module.compile`: the module and its state-dict names stay),
    after activation checkpointing and before FSDP or DDP wrap it, torchtitan's
    order; `mode`: torch.compile's ('reduce-overhead': CUDA graphs, for
    TRAIN.CUDA_GRAPHS). Compilation happens at the first call."""
    if how == "block":
        for block in encoder_blocks(model):
            block.compile(mode=mode)
    elif how == "model":
        model.compile(mode=mode)
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside a DDP wrapper (FSDP shards in place: nothing to unwrap)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank holds in parameters, gradients and optimizer state: a sharded
    model holds only its shards. Returns {params, grads, optimizer, total}."""
    params = list(model.parameters())
    p = sum(_nbytes(x) for x in params)
    g = sum(_nbytes(x.grad) for x in params if x.grad is not None)
    o = 0
    for state in optimizer.state.values():
        for v in state.values():
            if torch.is_tensor(v) and v.ndim > 0:  # not the scalar step counters
                o += _nbytes(v)
    return {"params": p, "grads": g, "optimizer": o, "total": p + g + o}


def _nbytes(t):
    t = distributed.local_tensor(t)
    return t.numel() * t.element_size()
