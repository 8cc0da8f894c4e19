"""A model built on the meta device, parallelized, then given this rank's values.

    with torch.device("meta"):
        model = build_model(cfg)                # shapes only: no memory, no init
    ...  apply TP, split the pipeline, fully_shard (all on the meta device)
    materialize(model, device, full_tensor)    # this rank's shards, filled
    copy_full_tensors(model, source)           # later: weights, one tensor at a time

torchtitan's order: the whole model never exists on any rank. `materialize`
allocates only what this rank holds (`to_empty`: FSDP shards, tensor-parallel
slices, pipeline stages), then fills each tensor from its full value, produced one
at a time on the CPU by the caller (the model's own init, or a checkpoint's tensor)
and cut to this rank's piece here. So a rank's peak is its shards plus the largest
single tensor, and the values do not depend on the layout: every layout cuts its
pieces out of the same full tensors.

The cut follows the DTensor's placements (FSDP's Shard(0), TP's row or column
split, the two combined; `compute_local_shape_and_global_offset`, DCP's own
function); tensor-parallel q/k/v projections are first put in the rank order that
`apply_tp` gives their rows (parallel/tensor_parallel.py).
"""

from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from pycls_fast.parallel.tensor_parallel import QKV_SUFFIXES, qkv_rank_order

# (state-dict name, the tensor this rank holds) -> its full value in pycls's
# layout (CPU, any dtype), or None to leave the tensor as it is.
FullTensor = Callable[[str, torch.Tensor], torch.Tensor | None]


def named_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(state-dict name, tensor) of every parameter and buffer of `model` (DTensors
    for sharded ones); each object once."""
    yield from model.named_parameters()
    yield from model.named_buffers()


def local_piece(t: torch.Tensor, full: torch.Tensor, name: str) -> torch.Tensor:
    """The part of `full` (the whole value of `name`, pycls's row order) that
    `t` holds on this rank: `full` itself for a plain tensor, the slice of the
    DTensor's local shard otherwise (a view of `full`, or of its reordered copy
    for a tensor-parallel q/k/v projection)."""
    if tuple(full.shape) != tuple(t.shape):
        raise ValueError(
            f"{name}: full tensor of shape {tuple(full.shape)} for a tensor of "
            f"shape {tuple(t.shape)}"
        )
    if not isinstance(t, DTensor):
        return full
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    tp = _tp_of(t)
    if tp > 1 and name.endswith(QKV_SUFFIXES):
        full = full[qkv_rank_order(full.size(0), tp)]
    sizes, offsets = compute_local_shape_and_global_offset(
        t.shape, t.device_mesh, t.placements
    )
    return full[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))]


def _tp_of(t: DTensor) -> int:
    names = t.device_mesh.mesh_dim_names or ()
    return t.device_mesh.size(names.index("tp")) if "tp" in names else 1


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@torch.no_grad()
def copy_full_tensors(model: nn.Module, full_tensor: FullTensor) -> list[str]:
    """Copies into every tensor of `model` this rank's piece of its full value
    (`full_tensor(name, t)`, asked for one tensor at a time; None leaves it);
    returns the names it set."""
    done = []
    for name, t in named_tensors(model):
        full = full_tensor(name, t)
        if full is None:
            continue
        _local(t).copy_(local_piece(t, full, name))
        done.append(name)
    return done


def materialize(
    model: nn.Module, device: torch.device, full_tensor: FullTensor
) -> nn.Module:
    """Allocates `model`'s tensors (on the meta device, already split or sharded)
    on `device`, this rank's shards only, and fills every one of them from
    `full_tensor` (which must give them all); returns `model`."""
    model.to_empty(device=device)
    missing = set(dict(named_tensors(model))) - set(
        copy_full_tensors(model, full_tensor)
    )
    if missing:
        raise ValueError(f"no initial value for {sorted(missing)[0]}")
    return model


def full_init(init: Callable[[str, torch.Tensor], None]) -> FullTensor:
    """A FullTensor that makes each full tensor on the CPU and fills it with
    `init(name, full)`: floats in torch's default dtype (the dtype the model was
    built in: half-precision modes cast after init, as they did on a whole model),
    others in their own."""

    def make(name: str, t: torch.Tensor) -> torch.Tensor:
        dtype = torch.get_default_dtype() if t.is_floating_point() else t.dtype
        full = torch.empty(tuple(t.shape), dtype=dtype, device="cpu")
        init(name, full)
        return full

    return make


def is_meta(model: nn.Module) -> bool:
    """Whether `model` still has tensors on the meta device (not yet
    materialized)."""
    return any(_local(t).is_meta for _, t in named_tensors(model))


__all__ = [
    "FullTensor",
    "copy_full_tensors",
    "full_init",
    "is_meta",
    "local_piece",
    "materialize",
    "named_tensors",
]
