"""The model of a run, built sharded: no rank ever holds the whole model.

    parts = build_model_parts(cfg, device, mode, half, layout, mesh, pp_rank)
    parts.trained, parts.model, parts.ema, parts.pipeline, parts.loaded

torchtitan's order. The model is built on the meta device (shapes, no memory),
cast for the AMP mode, split into this rank's pipeline stages, split by tensor
parallelism, checkpointed, compiled and sharded by FSDP -- all still on the meta
device. Then `materialize` allocates this rank's shards on the device and fills
them from pycls main's init, one full tensor at a time on the CPU (each drawn from
the model's seed and its name: the same initial weights at every layout).
TRAIN.WEIGHTS / TEST.WEIGHTS go into the shards the same way, one tensor at a time.
The EMA is a meta copy sharded alike and filled from the model's shards; DDP wraps
last (it broadcasts values). A rank's peak is its shards plus the largest tensor.
"""

import logging
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn
from yacs.config import CfgNode

from pycls_fast.checkpoint.weights import LoadedWeights, load_model_weights
from pycls_fast.components.ema import create_ema, ema_enabled, fill_ema
from pycls_fast.components.float8 import (
    compile_warning,
    convert_to_float8,
    describe_float8,
    float8_tp_styles,
    fp8_device_refusal,
    fp8_enabled,
)
from pycls_fast.components.precision import AmpMode, prepare_model
from pycls_fast.errors import DeviceError
from pycls_fast.models import build_model
from pycls_fast.models.vit import init_tensor
from pycls_fast.parallel.data_parallel import (
    fsdp_enabled,
    shard,
    shard_model,
    unwrap,
    wrap_data_parallel,
)
from pycls_fast.parallel.materialize import full_init, materialize
from pycls_fast.parallel.mesh import Layout
from pycls_fast.parallel.pipeline import (
    PipelineRunner,
    split_model,
    stage_bounds,
    stage_union,
    stages_per_rank,
)
from pycls_fast.parallel.tensor_parallel import apply_tp, sequence_parallel

logger = logging.getLogger(__name__)


@dataclass
class ModelParts:
    """The model of a run on this rank (see Components in engine/trainer.py)."""

    trained: nn.Module
    model: nn.Module
    ema: nn.Module | None = None
    pipeline: PipelineRunner | None = None
    ema_pipeline: PipelineRunner | None = None
    loaded: LoadedWeights | None = None


def build_model_parts(
    cfg: CfgNode,
    device: torch.device,
    mode: AmpMode,
    half: torch.dtype,
    layout: Layout,
    mesh,
    pp_rank: int,
    *,
    weights: str | None = None,
    use_ema: bool = False,
    model: nn.Module | None = None,
) -> ModelParts:
    """This rank's model, EMA and pipeline, built sharded (module docstring).
    `weights`: a checkpoint loaded into the shards (its EMA weights with
    `use_ema`); TRAIN.WEIGHTS too when training. `model`: a module with values
    to use in place of the config's (it is moved whole to `device`, then
    parallelized: for peer implementations in benchmarks)."""
    given = model is not None
    if fp8_enabled(cfg) and not given:
        # A given model is the dry run's (fake tensors on the CPU device type,
        # standing for a GPU's) or a benchmark's peer: its device is not the run's.
        refusal = fp8_device_refusal(device, cfg.AMP.FP8_EMULATE)
        if refusal:
            raise DeviceError(refusal)
        if warning := compile_warning(cfg):
            logger.warning("warning: %s", warning)
    if given:
        model.to(device)
    else:
        with torch.device("meta"):
            model = build_model(cfg)
    # The whole model's names and shapes (meta tensors), for checking weights.
    reference = {k: v.to("meta") for k, v in model.state_dict().items()}
    init = None if given else full_init(partial(_init, model.params, model.init_seed))
    if not (fsdp_enabled(cfg) and mode is AmpMode.O2):
        # FSDP O2 keeps fp32 shards (the master weights) and casts when gathering.
        prepare_model(model, mode, half, cfg.AMP.LAYER_NORM_FP32)
    stages = split_model(model, cfg, pp_rank) if layout.pp > 1 else [(0, model)]
    emas = [(i, create_ema(m)) for i, m in stages] if ema_enabled(cfg) else None
    for _, m in stages:
        _split_and_shard(m, cfg, mode, half, layout, mesh)
        if init is not None:
            materialize(m, device, init)
    union = stage_union([m for _, m in stages])
    if not given and cfg.TRAIN.WEIGHTS:
        start = load_model_weights(
            union,
            cfg.TRAIN.WEIGHTS,
            allow_missing_head=True,
            reset_head=cfg.TRAIN.RESET_HEAD,
            reference=reference,
        )
        logger.info("TRAIN.WEIGHTS: %s", start.describe())
    loaded = None
    if weights:
        loaded = load_model_weights(
            union, weights, use_ema=use_ema, reference=reference
        )
        logger.info("%s", loaded.describe())
    if emas is not None:
        for (_, e), (_, m) in zip(emas, stages):
            _split_and_shard(e, cfg, mode, half, layout, mesh, ema=True)
            fill_ema(e, m, device)
    dp_mesh = mesh["dp"] if mesh is not None else None
    stages = [(i, wrap_data_parallel(m, cfg, mode, device, dp_mesh)) for i, m in stages]
    if layout.pp == 1:
        trained = stages[0][1]
        ema = emas[0][1] if emas is not None else None
        return ModelParts(trained, unwrap(trained), ema, loaded=loaded)
    group = mesh["pp"].get_group()
    pipeline = PipelineRunner(stages, cfg, group, device)
    ema = ema_pipeline = None
    if emas is not None:
        ema = stage_union([e for _, e in emas])
        ema_pipeline = PipelineRunner(emas, cfg, group, device, train=False)
    logger.info(
        "pipeline: %d stages (%s), blocks %s on this rank, %d micro-batches",
        layout.pp * stages_per_rank(cfg),
        cfg.PARALLEL.PP_SCHEDULE,
        ", ".join(f"stage {i}: {b[0]}-{b[1] - 1}" for i, b in _bounds(cfg, stages)),
        pipeline.n_micro,
    )
    # The optimizer, EMA updates and checkpoints see the rank's stages as one
    # module with the whole model's parameter names.
    return ModelParts(union, union, ema, pipeline, ema_pipeline, loaded)


def _init(params, seed, name, full):
    init_tensor(params, name, full, seed)


def _split_and_shard(model, cfg, mode, half, layout, mesh, ema=False):
    """AMP.FP8's float8 linears, tensor parallelism (if any), then checkpointing,
    compile and FSDP over the data-parallel ranks, in place (on the meta device,
    before any value exists). `ema`: the EMA copy, split and sharded like the model
    (its updates are per local tensor), and neither converted, checkpointed nor
    compiled."""
    dp_mesh = mesh["dp"] if mesh is not None else None
    if not ema and fp8_enabled(cfg):
        # Before TP (torchao's float8 styles take Float8Linear) and FSDP (its float8
        # all-gather takes the float8 weights). The EMA stays in high precision: it
        # is evaluated and exported as such.
        converted = convert_to_float8(model, cfg)
        logger.info("%s", describe_float8(cfg, converted))
    if layout.tp > 1:
        sp = sequence_parallel(cfg)
        styles = None if ema else float8_tp_styles(cfg, mesh["tp"].device_type)
        apply_tp(model, mesh["tp"], sp, styles)
        if not ema:
            logger.info(
                "tensor parallel over %d ranks, sequence parallel %s", layout.tp, sp
            )
    if not ema:
        shard(model, cfg, mode, half, dp_mesh)
    elif fsdp_enabled(cfg):
        shard_model(model, cfg, mode, half, dp_mesh)


def _bounds(cfg, stages):
    bounds = stage_bounds(cfg, cfg.PARALLEL.PP * stages_per_rank(cfg))
    return [(i, bounds[i]) for i, _ in stages]
