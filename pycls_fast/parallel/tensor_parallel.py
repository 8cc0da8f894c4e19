"""Tensor parallelism (Megatron's split) of the ViT's encoder blocks, with DTensor.

    apply_tp(model, tp_mesh, sequence_parallel)   # in place, before FSDP

Each block's attention projection `attn_proj` and MLP `linear_1` are split by rows
(output columns: ColwiseParallel), `out_proj` and `linear_2` by columns
(RowwiseParallel), so a block costs two all-reduces forward and two backward; each
rank runs NUM_HEADS / TP heads and MLP_DIM / TP hidden units. The stem, tokens,
position embedding, final LayerNorm and head (and, without sequence parallelism, the
blocks' LayerNorms) stay whole on every rank: plain tensors, computed alike, whose
gradients would come out equal on every rank if every kernel were deterministic
(the block inputs' gradients are all-reduced on their way back). cuDNN's and the
fused kernels' weight gradients are not bit-reproducible, so the replicas could
drift apart while a checkpoint saves one of them: `average_replicated_grads`
averages their gradients over the TP ranks every step (one all-reduce per dtype
of the few replicated tensors), which keeps them identical.

With sequence parallelism (Korthikanti et al., https://arxiv.org/abs/2205.05198) the
residual stream between the blocks' matmuls is split along the sequence: the
LayerNorms, LayerScales, residual adds and stochastic depth run on SEQ / TP tokens,
and the all-reduces become all-gathers and reduce-scatters of the same volume.

The packed q/k/v projection. `attn_proj` holds q, k and v as three (HIDDEN, HIDDEN)
row blocks (pycls's and timm's order). An even split of its rows would give rank 0
all of q and half of k, so `apply_tp` reorders the rows rank by rank: rank r holds
[q_r; k_r; v_r], the rows of its own heads, and the model's attention (which takes
its head width from the projection's output) runs unchanged on NUM_HEADS / TP heads.
Checkpoints keep pycls's order: `to_checkpoint` names each rank's three row blocks by
their offsets in the q/k/v order (DCP's CheckpointableTensor protocol, several
chunks per rank), so a TP checkpoint loads at any other layout and the reverse.
"""

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from yacs.config import CfgNode

from pycls_fast.models.vit import LayerScale, ViT, ViTEncoderBlock

# The state-dict names whose rows apply_tp reorders (and to_checkpoint maps back).
QKV_SUFFIXES = ("attn_proj.weight", "attn_proj.bias")


# The block matmuls split by output rows (ColwiseParallel, with their biases) and by
# input columns (RowwiseParallel; the bias stays whole): `_block_plan` and the
# planner's per-rank shares both follow these names.
ROW_SPLIT = ("attn_proj", "linear_1")
COLUMN_SPLIT = ("out_proj", "linear_2")


def sequence_parallel(cfg: CfgNode, tp: int | None = None) -> bool:
    """PARALLEL.SEQUENCE_PARALLEL where it applies: TP (PARALLEL.TP unless given)
    > 1 and the token count of every image size the run uses divisible by TP
    (DTensor's sequence split takes even shards; a class token makes 197 tokens of a
    224 px, 16 px patch image)."""
    tp = tp or cfg.PARALLEL.TP
    if tp == 1 or not cfg.PARALLEL.SEQUENCE_PARALLEL:
        return False
    prefix = int(cfg.VIT.CLASSIFIER_TYPE == "token") + int(cfg.VIT.DISTILL_TOKEN)
    sizes = {cfg.TRAIN.IM_SIZE, cfg.TEST.IM_SIZE, *cfg.TEST.SIZES}
    seqs = {(s // cfg.VIT.PATCH_SIZE) ** 2 + prefix for s in sizes}
    return all(n % tp == 0 for n in seqs)


def qkv_rank_order(rows: int, tp: int) -> torch.Tensor:
    """Row permutation of a packed (3 x W, ...) q/k/v tensor: new[i] = old[perm[i]],
    rank r's rows [q_r; k_r; v_r] contiguous (W = rows / 3). int64 (rows,)."""
    w = rows // 3
    idx = torch.arange(rows).view(3, tp, w // tp)  # (q/k/v, rank, row)
    return idx.transpose(0, 1).reshape(-1)


def _canonical_runs(
    start: int, n: int, rows: int, tp: int
) -> list[tuple[int, int, int]]:
    """Rows [start, start + n) of the rank-ordered tensor as runs in pycls's q/k/v
    order: [(local offset, canonical offset, length)]."""
    w = rows // 3
    piece = w // tp  # rows of one of q, k, v on one rank
    runs, i = [], start
    while i < start + n:
        end = min(start + n, (i // piece + 1) * piece)
        r, j, t = i // (3 * piece), i % (3 * piece) // piece, i % piece
        runs.append((i - start, j * w + r * piece + t, end - i))
        i = end
    return runs


def _block_plan(seq_dim: int, sp: bool, styles: dict | None = None) -> dict:
    """The ParallelStyles of one encoder block (names relative to the block).
    `styles`: other classes for the 'colwise', 'rowwise' and module 'input' styles
    (AMP.FP8's float8 ones, components/float8.py), else torch's."""
    styles = styles or {}
    colwise = styles.get("colwise", ColwiseParallel)
    rowwise = styles.get("rowwise", RowwiseParallel)
    prepare = styles.get("input", PrepareModuleInput)
    if not sp:
        return {
            "self_attention.attn_proj": colwise(),
            "self_attention.out_proj": rowwise(),
            "mlp_block.linear_1": colwise(),
            "mlp_block.linear_2": rowwise(),
        }
    seq = Shard(seq_dim)
    return {
        "ln_1": SequenceParallel(sequence_dim=seq_dim),
        "self_attention": prepare(
            input_layouts=(seq,), desired_input_layouts=(Replicate(),)
        ),
        "self_attention.attn_proj": colwise(),
        "self_attention.out_proj": rowwise(output_layouts=seq),
        "ln_2": SequenceParallel(sequence_dim=seq_dim),
        "mlp_block": prepare(
            input_layouts=(seq,), desired_input_layouts=(Replicate(),)
        ),
        "mlp_block.linear_1": colwise(),
        "mlp_block.linear_2": rowwise(output_layouts=seq),
    }


def apply_tp(model: ViT, tp_mesh, sp: bool, styles: dict | None = None) -> ViT:
    """Splits every encoder block of `model` over the 1-D mesh `tp_mesh` (in place,
    before FSDP; the model is on the meta device, or its weights are equal on all
    its ranks). `sp`: sequence parallelism (see `sequence_parallel`); `styles`:
    see `_block_plan`."""
    tp = tp_mesh.size()
    seq_dim = 1 if model.batch_first else 0
    seq = Shard(seq_dim)
    blocks = [m for m in model.modules() if isinstance(m, ViTEncoderBlock)]
    for block in blocks:
        attn = block.self_attention
        if not attn.attn_proj.weight.is_meta:
            # A model on the meta device gets its rows in this order when it is
            # materialized (parallel/materialize.py).
            order = qkv_rank_order(attn.attn_proj.weight.size(0), tp)
            with torch.no_grad():
                attn.attn_proj.weight.copy_(attn.attn_proj.weight[order])
                attn.attn_proj.bias.copy_(attn.attn_proj.bias[order])
        # torchtitan's way: the module's head count becomes this rank's.
        attn.n_heads = attn.n_heads // tp
        plan = _block_plan(seq_dim, sp, styles)
        for name in ("q_norm", "k_norm"):
            # QK-norm's LayerNorm is shared by all heads and sees this rank's heads
            # only ((batch, heads, seq, head_d): dim 1): as a sequence-parallel norm,
            # its replicated weights' gradients are summed over the ranks.
            if isinstance(getattr(attn, name), nn.LayerNorm):
                plan[f"self_attention.{name}"] = SequenceParallel(
                    sequence_dim=1, use_local_output=True
                )
        if sp:
            for name in (
                "ls_1",
                "ls_2",
            ):  # a gamma sees SEQ / TP tokens: reduce its grad
                if isinstance(getattr(block, name), LayerScale):
                    plan[name] = SequenceParallel(
                        sequence_dim=seq_dim, use_local_output=True
                    )
        parallelize_module(block, tp_mesh, plan)
    if sp and model.encoder is not None:
        # The stream enters the encoder whole and is split there (a slice, no
        # communication); it leaves gathered, so a pipeline stage hands the next a
        # whole stream. On the encoder, not on a block: activation checkpointing
        # recomputes a block's forward without its input hooks.
        parallelize_module(
            model.encoder,
            tp_mesh,
            PrepareModuleInputOutput(
                input_layouts=(Replicate(),),
                desired_input_layouts=(seq,),
                use_local_input=True,
                output_layouts=(seq,),
                desired_output_layouts=(Replicate(),),
                use_local_output=True,
            ),
        )
        ln = getattr(model.encoder, "ln", None)
        if ln is not None:
            local = SequenceParallel(sequence_dim=seq_dim, use_local_output=True)
            parallelize_module(ln, tp_mesh, local)
    return model


def _on_tp_mesh(p: torch.Tensor) -> bool:
    return isinstance(p, DTensor) and "tp" in (p.device_mesh.mesh_dim_names or ())


def replicated_params(model: nn.Module) -> list[nn.Parameter]:
    """The trainable parameters of a tensor-parallel `model` that every TP rank
    holds whole (plain tensors, or FSDP shards over the 'dp' dimension only): the
    ones `average_replicated_grads` keeps equal. Every other one is a DTensor on
    the 'tp' mesh dimension, whose gradient DTensor reduces."""
    return [p for p in model.parameters() if p.requires_grad and not _on_tp_mesh(p)]


def average_replicated_grads(params: list[torch.Tensor], group) -> None:
    """Averages the gradients of `params` (replicated_params's) over the TP ranks
    of `group`, in place: one all-reduce per dtype of their local tensors."""
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    grads = [g.to_local() if isinstance(g, DTensor) else g for g in _grads(params)]
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    size = torch.distributed.get_world_size(group)
    for same in by_dtype.values():
        flat = _flatten_dense_tensors(same)
        torch.distributed.all_reduce(flat, group=group)
        flat.div_(size)
        torch._foreach_copy_(same, list(_unflatten_dense_tensors(flat, same)))


def _grads(params):
    return [p.grad for p in params if p.grad is not None]


def tp_size(model: nn.Module) -> int:
    """How many tensor-parallel ranks split `model` (1: none): the size of the 'tp'
    mesh dimension of its first DTensor parameter that has one."""
    for p in model.parameters():
        if isinstance(p, DTensor):
            names = p.device_mesh.mesh_dim_names or ()
            if "tp" in names:
                return p.device_mesh.size(names.index("tp"))
    return 1


def _local_rows(shape, mesh, placements):
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return compute_local_shape_and_global_offset(shape, mesh, placements)


def _is_qkv(key: str) -> bool:
    return any(s in key for s in QKV_SUFFIXES)


def to_checkpoint(state: dict, tp: int) -> dict:
    """`state` (a model or optimizer state dict, nested) with each tensor-parallel
    q/k/v DTensor replaced by its local tensor, annotated with its rows' offsets in
    pycls's q/k/v order (DCP's CheckpointableTensor protocol); DCP then saves or loads
    it in place as pieces of the canonical tensor. Other values are unchanged."""

    def convert(key, value):
        if isinstance(value, dict):
            return {k: convert(f"{key}.{k}", v) for k, v in value.items()}
        if tp == 1 or not (isinstance(value, DTensor) and _is_qkv(key)):
            return value
        from torch.distributed.tensor._utils import (
            compute_local_shape_and_global_offset,
        )

        sizes, offsets = compute_local_shape_and_global_offset(
            value.shape, value.device_mesh, value.placements
        )
        local = value.to_local()
        rows = value.shape[0]
        rest = tuple(value.shape[1:])
        zeros = (0,) * len(rest)
        runs = _canonical_runs(offsets[0], sizes[0], rows, tp) if sizes[0] else []
        local.global_shape = tuple(value.shape)
        local.global_offsets = tuple((c, *zeros) for _, c, _ in runs)
        local.local_offsets = tuple((lo, *zeros) for lo, _, _ in runs)
        local.local_sizes = tuple((n, *rest) for _, _, n in runs)
        return local

    return {k: convert(k, v) for k, v in state.items()}


def canonical_state_dict(model: nn.Module, tp: int) -> dict[str, torch.Tensor]:
    """The full model state on every rank (DTensors gathered), attn_proj rows back in
    pycls's q/k/v order: equal to one process's state dict. For tests and tools."""
    out = {}
    for key, value in model.state_dict().items():
        if isinstance(value, DTensor):
            value = value.full_tensor()
        if tp > 1 and _is_qkv(key):
            # Back to pycls's order: the inverse of apply_tp's row permutation.
            order = qkv_rank_order(value.size(0), tp)
            inverse = torch.empty_like(order)
            inverse[order] = torch.arange(order.numel())
            value = value[inverse]
        out[key] = value.detach()
    return out


def grad_norm(params: list[torch.Tensor], group=None) -> torch.Tensor:
    """The total 2-norm of the gradients of `params`, which may mix DTensors (on one
    or more meshes) and plain tensors: each DTensor's reduced over its mesh and each
    plain gradient counted once (plain parameters are replicated alike on every
    rank); `group`: the pipeline stages, whose parameters are disjoint (their
    squares are summed). A 0-d float32 device tensor (nothing read to the host)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads and group is None:
        return torch.zeros(())
    squares = []
    by_mesh: dict = {}
    plain = []
    for g in grads:
        if isinstance(g, DTensor):
            by_mesh.setdefault((g.device_mesh, g.placements), []).append(g)
        else:
            plain.append(g)
    for same_kind in by_mesh.values():
        norms = torch._foreach_norm(same_kind, 2.0)
        total = torch.linalg.vector_norm(
            torch.stack([_at_least_fp32(n) for n in norms])
        )
        squares.append(total.full_tensor() ** 2)
    if plain:
        norms = torch._foreach_norm(plain, 2.0)
        squares.append(torch.stack([_at_least_fp32(n) for n in norms]).square().sum())
    total = torch.stack(squares).sum() if squares else torch.zeros(())
    if group is not None:
        torch.distributed.all_reduce(total, group=group)
    return total.sqrt()


def clip_grad_norm_(
    params: list[torch.Tensor], max_norm: float, group=None
) -> torch.Tensor:
    """torch's clip_grad_norm_ over parameters that may mix DTensors and plain
    tensors (`grad_norm`); returns the norm before clipping, a 0-d float32
    tensor."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = grad_norm(params, group)
    if not grads and group is None:
        return norm
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    if local:
        torch._foreach_mul_(local, coef.to(local[0].device))
    return norm


def _at_least_fp32(t: torch.Tensor) -> torch.Tensor:
    # Half-precision norms are summed in fp32; float64 ones (parity tests) stay.
    return t.to(torch.promote_types(t.dtype, torch.float32))
