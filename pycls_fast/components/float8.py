"""AMP.FP8: the encoder blocks' linear layers as torchao's float8 linears.

    refusal = fp8_device_refusal(device, emulate)    # None where fp8 matmuls run
    convert_to_float8(model, cfg)                     # in place, on the meta device
    ... TP (float8_tp_styles), FSDP, materialize ...
    scales = float8_scale_updater(model)             # after each optimizer step

Each converted `nn.Linear` becomes torchao's `Float8Linear` (the same parameters
under the same names, so checkpoints and exports do not change): its three matmuls
(output, input gradient, weight gradient) take float8 operands, scaled
dynamically: e4m3 for inputs and weights, e5m2 for output gradients ('tensorwise',
one scale per tensor) or e4m3 for all with a power-of-2 scale per row
('rowwise'). The high-precision weights stay the master copy the optimizer
updates; the float8 casts are made per use.

Converted: q/k/v, the attention projection and the MLP's two layers of every
encoder block, the matmuls that hold nearly all of a ViT's flops. Not converted:
the patchify stem (a convolution: torchao converts only Linear layers), the head
(NUM_CLASSES outputs, rarely a multiple of 16, and the logits feed the loss
directly) and the norms (not matmuls). torchao needs the converted layers' dims
to be multiples of 16 (config.py refuses others).

Under FSDP with 'tensorwise', FSDP all-gathers the weights in float8 (half the
bytes of bf16) with scales computed for all of them in one all-reduce after each
optimizer step (`float8_scale_updater`), torchtitan's recipe. Under tensor
parallelism with 'tensorwise', torchao's float8 styles do the colwise / rowwise
splits and all-gather the sequence-parallel activations in float8.
"""

import dataclasses
import logging
from collections.abc import Callable

import torch
from torch import nn
from yacs.config import CfgNode

from pycls_fast.errors import UserError

# The encoder block's linear layers that become float8 (names relative to the block,
# as models/vit.py names them).
FLOAT8_LAYERS = (
    "self_attention.attn_proj",
    "self_attention.out_proj",
    "mlp_block.linear_1",
    "mlp_block.linear_2",
)

# The first CUDA compute capability with float8 tensor cores (Ada, sm89; Hopper is
# sm90).
FP8_CAPABILITY = (8, 9)

# Machine epsilon (2^-mantissa bits) of the float8 formats: e4m3 for inputs and
# weights, e5m2 for tensorwise output gradients.
FP8_EPS = {"e4m3": 2.0**-3, "e5m2": 2.0**-2}


def fp8_enabled(cfg: CfgNode) -> bool:
    return bool(cfg.AMP.FP8)


def require_torchao() -> None:
    """UserError in one line when torchao (setup.py's extra 'fp8') is missing."""
    # torchao registers an Enum as a pytree node on import, which torch logs as a
    # deprecation warning on the user's terminal: torchao's to mend, not the user's.
    pytree_log = logging.getLogger("torch.utils._pytree")
    level = pytree_log.level
    pytree_log.setLevel(logging.ERROR)
    try:
        import torchao.float8  # noqa: F401
    except ImportError as e:
        raise UserError(
            f"AMP.FP8 True needs torchao ({e}): pip install 'torchao>=0.18' (the "
            "package's extra 'fp8'; the locks pin it)"
        ) from None
    finally:
        pytree_log.setLevel(level)


def check_fp8_launch(cfg: CfgNode) -> None:
    """Before a local launch starts any rank: UserError (one line) when AMP.FP8
    cannot run on this machine (torchao missing; no float8 matmuls on its first
    GPU, or no GPU). A SLURM job's nodes are checked where they run."""
    if not fp8_enabled(cfg) or cfg.LAUNCH.MODE == "slurm":
        return
    require_torchao()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    refusal = fp8_device_refusal(device, cfg.AMP.FP8_EMULATE)
    if refusal:
        raise UserError(refusal)


def fp8_device_refusal(device: torch.device, emulate: bool) -> str | None:
    """Why `device` cannot run AMP.FP8's float8 matmuls (one line), or None: CPUs
    and GPUs below compute capability 8.9 have none, unless AMP.FP8_EMULATE runs
    them in fp32 (tests)."""
    if emulate:
        return None
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) >= FP8_CAPABILITY:
            return None
        have = f"compute capability {major}.{minor}"
    else:
        have = f"a {device.type} device"
    return (
        f"AMP.FP8 True needs a GPU with float8 matmuls (compute capability "
        f"{FP8_CAPABILITY[0]}.{FP8_CAPABILITY[1]}+: H100, H200, L4), but this run "
        f"has {have}: set AMP.FP8 False (AMP.FP8_EMULATE True emulates them in "
        "fp32, for tests)"
    )


def is_float8_layer(fqn: str) -> bool:
    """Whether the module named `fqn` (in the whole model or a pipeline stage) is
    one of an encoder block's converted linear layers."""
    return ".block_" in f".{fqn}" and fqn.endswith(FLOAT8_LAYERS)


def float8_linear_config(cfg: CfgNode, fsdp: bool):
    """torchao's Float8LinearConfig of AMP.FP8_RECIPE, emulated with
    AMP.FP8_EMULATE; `fsdp`: float8 all-gather of the weights (tensorwise only:
    torchao's rowwise weights have a scale per row of the whole tensor)."""
    from torchao.float8 import Float8LinearConfig

    config = Float8LinearConfig.from_recipe_name(cfg.AMP.FP8_RECIPE)
    return dataclasses.replace(
        config,
        emulate=cfg.AMP.FP8_EMULATE,
        enable_fsdp_float8_all_gather=fsdp and cfg.AMP.FP8_RECIPE == "tensorwise",
        # torch's float8 matmul needs the inner dim a multiple of 16: the weight
        # gradient's is the token count of a micro-batch (197 x 3 for three
        # 224 px images), padded where it is not.
        pad_inner_dim=True,
    )


def convert_to_float8(model: nn.Module, cfg: CfgNode) -> list[str]:
    """Replaces the encoder blocks' linear layers of `model` (on the meta device,
    before tensor parallelism and FSDP) with Float8Linear, in place; returns the
    converted names. The other layers stay as they are (module docstring)."""
    if not fp8_enabled(cfg):
        return []
    from torchao.float8 import convert_to_float8_training

    config = float8_linear_config(cfg, fsdp=cfg.FSDP.ENABLED)
    converted = []

    def wanted(module: nn.Module, fqn: str) -> bool:
        if isinstance(module, nn.Linear) and is_float8_layer(fqn):
            converted.append(fqn)
            return True
        return False

    convert_to_float8_training(model, module_filter_fn=wanted, config=config)
    for fqn in converted:
        model.get_submodule(fqn).register_forward_pre_hook(_autocast_input)
    return converted


def _autocast_input(module: nn.Module, args: tuple) -> tuple:
    """Float8Linear casts its input to CUDA autocast's dtype only; this does the
    same under the CPU's autocast, so that a CPU run (tests, the dry run) keeps for
    backward what a GPU run keeps: the input in half precision."""
    from torchao.float8.distributed_utils import tensor_already_casted_to_fp8

    (x,) = args
    kind = x.device.type
    if kind == "cuda" or not torch.is_autocast_enabled(kind):
        return args
    if tensor_already_casted_to_fp8(x) or not x.is_floating_point():
        return args  # cast to float8 by a tensor-parallel style already
    return (x.to(torch.get_autocast_dtype(kind)),)


def float8_tp_styles(cfg: CfgNode, device_type: str) -> dict | None:
    """The tensor-parallel styles of the float8 linears (colwise, rowwise, module
    input), as `parallel/tensor_parallel.py` names them, or None for torch's own.
    'tensorwise' on CUDA: torchao's float8 styles (activations all-gathered in
    float8). torch's where those cannot run: 'rowwise' (torchao's styles assume one
    scale per tensor; torchtitan does the same) and CPU process groups (gloo has no
    float8 types: "Invalid scalar type"), where the float8 layers' matmuls run
    float8 all the same and their collectives move high-precision tensors."""
    if (
        not fp8_enabled(cfg)
        or cfg.AMP.FP8_RECIPE != "tensorwise"
        or device_type != "cuda"
    ):
        return None
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    return {
        "colwise": Float8ColwiseParallel,
        "rowwise": Float8RowwiseParallel,
        "input": PrepareFloat8ModuleInput,
    }


def float8_scale_updater(model: nn.Module) -> Callable[[], None] | None:
    """What to call after each optimizer step of `model`: the float8 scales of its
    FSDP-sharded float8 weights, computed in one all-reduce for all of them (else
    each weight's all-gather reduces its own); None when it has none."""
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    from pycls_fast.runtime.distributed import local_tensor

    if not any(
        isinstance(local_tensor(p), WeightWithDynamicFloat8CastTensor)
        for p in model.parameters()
    ):
        return None
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    return lambda: precompute_float8_dynamic_scale_for_fsdp(model)


def compile_warning(cfg: CfgNode) -> str | None:
    """The warning for AMP.FP8 run eagerly (neither TRAIN.COMPILE nor
    TRAIN.CUDA_GRAPHS, which compiles the model): eager float8 runs each
    scale and cast as its own kernels, slower than bf16 (torchao fuses them through
    torch.compile)."""
    compiled = cfg.TRAIN.COMPILE != "off" or cfg.TRAIN.CUDA_GRAPHS  # graphs compile
    if fp8_enabled(cfg) and not compiled and not cfg.AMP.FP8_EMULATE:
        return (
            "AMP.FP8 without TRAIN.COMPILE: float8's casts run unfused, usually "
            "slower than bf16; set TRAIN.COMPILE block"
        )
    return None


def describe_float8(cfg: CfgNode, converted: list[str]) -> str:
    """One log line: the recipe, how many layers, emulated or not."""
    how = "emulated in fp32" if cfg.AMP.FP8_EMULATE else "float8 matmuls"
    return (
        f"AMP.FP8: {len(converted)} encoder linear layers as Float8Linear "
        f"({cfg.AMP.FP8_RECIPE}, {how}); stem, head and norms unchanged"
    )


__all__ = [
    "FLOAT8_LAYERS",
    "require_torchao",
    "FP8_EPS",
    "check_fp8_launch",
    "compile_warning",
    "convert_to_float8",
    "describe_float8",
    "float8_linear_config",
    "float8_scale_updater",
    "float8_tp_styles",
    "fp8_device_refusal",
    "fp8_enabled",
    "is_float8_layer",
]
