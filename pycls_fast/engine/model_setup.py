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

Around the model, `build_components` builds the rest of what a run is made of
(`Components`): precision, optimizer, loss scaler, loss, distillation, spike guard,
the loaders and their device-side batch preparation.
"""

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from yacs.config import CfgNode

from pycls_fast.checkpoint.weights import LoadedWeights, load_model_weights
from pycls_fast.components.ema import create_ema, ema_enabled, fill_ema
from pycls_fast.components.float8 import (
    compile_warning,
    convert_to_float8,
    describe_float8,
    float8_scale_updater,
    float8_tp_styles,
    fp8_device_refusal,
    fp8_enabled,
    require_torchao,
)
from pycls_fast.components.losses import build_loss
from pycls_fast.components.meters import EpochMeter
from pycls_fast.components.optimizer import (
    construct_optimizer,
    param_groups,
    split_by_tensor_kind,
)
from pycls_fast.components.precision import (
    AmpMode,
    LossScaler,
    MasterWeights,
    autocast,
    input_dtype,
    loss_scaler,
    prepare_model,
    resolve_amp,
    weight_cache,
)
from pycls_fast.components.spike_guard import SpikeGuard, build_spike_guard
from pycls_fast.datasets.loader import (
    ImageLoader,
    construct_test_loader,
    construct_train_loader,
)
from pycls_fast.datasets.to_device.prefetch import DevicePrefetcher
from pycls_fast.datasets.to_device.transform import DeviceBatchTransform
from pycls_fast.engine.distill import Distiller, build_distiller
from pycls_fast.engine.run_metrics import RunMetrics
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
from pycls_fast.parallel.mesh import Layout, build_mesh
from pycls_fast.parallel.pipeline import (
    PipelineRunner,
    split_model,
    stage_bounds,
    stage_union,
    stages_per_rank,
)
from pycls_fast.parallel.tensor_parallel import (
    apply_tp,
    replicated_params,
    sequence_parallel,
)
from pycls_fast.runtime import distributed

logger = logging.getLogger(__name__)


@dataclass
class ModelParts:
    """The model of a run on this rank (see Components below)."""

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
    if fp8_enabled(cfg):
        require_torchao()
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


@dataclass
class Components:
    """Everything a training run is made of (built once, from the config)."""

    cfg: CfgNode
    device: torch.device
    mode: AmpMode
    # AMP.DTYPE: the half-precision dtype of the O1/O2/O3 modes (unused in fp32).
    half_dtype: torch.dtype
    # What forward and backward go through: a DDP wrapper, or the model itself
    # sharded in place by FSDP (or the plain model in one process).
    trained: torch.nn.Module
    # The model inside it: evaluated, updated into the EMA, saved.
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scaler: LossScaler
    master: MasterWeights | None = None
    ema: torch.nn.Module | None = None
    train_loader: ImageLoader | None = None
    test_loader: ImageLoader | None = None
    train_prep: DeviceBatchTransform | None = None
    test_prep: DeviceBatchTransform | None = None
    # The loaders' batches prepared on the device (a side stream copies batch i+1
    # while step i runs, on CUDA); the train one is the checkpoint's batch RNG.
    train_batches: DevicePrefetcher | None = None
    test_batches: DevicePrefetcher | None = None
    # The optimizer's parameters (fp32 masters under O2), for unscaling and clipping.
    opt_params: list[torch.Tensor] = field(default_factory=list)
    # This rank's sums of the epoch in training; checkpoints keep them (a Stateful
    # of CheckpointManager) so that an epoch resumed mid-way reports all of it.
    train_meter: EpochMeter = field(default_factory=EpochMeter)
    # Training iterations per epoch by (image size, batch) stage: iterations_before.
    stage_lengths: dict[tuple[int, int], int] = field(default_factory=dict)
    # What `weights` loaded (test_model): file, EMA or not, training epoch.
    loaded: LoadedWeights | None = None
    # The training loss (TRAIN.LOSS): (float32 logits, targets) -> mean loss.
    loss_fn: Callable = F.cross_entropy
    # DeiT's distillation (DISTILL.*): the teacher and its loss; None without.
    distiller: Distiller | None = None
    # TRAIN.SPIKE_FACTOR: skips steps whose loss spikes; None when off.
    spike_guard: SpikeGuard | None = None
    # The (pp, dp, tp) layout of the ranks (parallel/mesh.py), its mesh (None without
    # tensor or pipeline parallelism) and this rank's data-parallel index.
    layout: Layout = field(default_factory=Layout)
    mesh: object = None
    data_rank: int = 0
    # Whether this rank's losses and errors count in the meters: one rank per
    # data-parallel replica (the first tensor-parallel rank of the last stage).
    reports_metrics: bool = True
    # PARALLEL.PP: this rank's pipeline stages under their schedule, and the EMA's
    # (evaluation only); `trained`, `model` and `ema` are then the stages' union.
    pipeline: PipelineRunner | None = None
    ema_pipeline: PipelineRunner | None = None
    # The last step's gradient norm before clipping (0-d float32, on the device:
    # read at log lines only) and the run's figures for the records (train_model).
    grad_norm: torch.Tensor | None = None
    metrics: RunMetrics | None = None
    # Called before the optimizer changes the weights (an asynchronous checkpoint
    # still copying them waits there).
    before_update: Callable[[], None] | None = None
    # PARALLEL.TP: the parameters every TP rank holds whole, whose gradients are
    # averaged over the TP group (`tp_group`) each step so that they stay equal.
    tp_replicated: list[torch.Tensor] = field(default_factory=list)
    tp_group: object = None
    # Called after the optimizer changed them: AMP.FP8's float8 scales of FSDP's
    # float8 all-gathers, for all weights in one all-reduce (components/float8.py).
    after_update: Callable[[], None] | None = None

    def autocast(self, mode: AmpMode | None = None):
        """The autocast context of this run's forward passes in `mode` (default: the
        run's), with autocast's weight cache off under FSDP (`weight_cache`)."""
        mode = self.mode if mode is None else mode
        cache = weight_cache(self.cfg)
        return autocast(self.device.type, mode, self.half_dtype, cache=cache)

    def attach_test_loader(self, cfg: CfgNode, class_subset: bool = False) -> None:
        """Builds the test loader of `cfg` (TEST.SPLIT, sizes) and its device-side
        preparation into these components (`class_subset`: construct_test_loader's)."""
        dtype = input_dtype(self.mode, self.half_dtype)
        self.test_loader = construct_test_loader(
            cfg, self.data_rank, self.layout.dp, class_subset
        )
        self.test_prep = DeviceBatchTransform(
            cfg, self.device, dtype, False, self.data_rank
        )
        self.test_batches = DevicePrefetcher(self.test_loader, self.test_prep)


def build_components(
    cfg, *, loaders=("train", "test"), weights=None, use_ema=False, model=None
):
    """Builds the model, precision, parallel wrapper, optimizer, scaler, EMA and the
    loaders (and their device-side batch preparation) of the splits named in
    `loaders`. The model is built sharded (engine/model_setup.py): no rank holds
    the whole of it. `weights`: a checkpoint to load into the model's shards (its
    EMA weights with `use_ema`). `model`: another nn.Module to train in place of
    the config's (e.g. a peer implementation in benchmarks)."""
    device = distributed.device()
    mode, half = resolve_amp(cfg)
    layout = Layout.from_cfg(cfg, distributed.world_size())
    mesh = build_mesh(layout, device.type) if layout.model_parallel else None
    pp_i, data_rank, tp_i = layout.coords(distributed.rank())
    built = build_model_parts(
        cfg,
        device,
        mode,
        half,
        layout,
        mesh,
        pp_i,
        weights=weights,
        use_ema=use_ema,
        model=model,
    )
    model, trained, ema = built.model, built.trained, built.ema
    fsdp = fsdp_enabled(cfg)
    distiller = None
    if weights is None:  # training: the teacher, if any
        dp_mesh = mesh["dp"] if mesh is not None else None
        distiller = build_distiller(cfg, device, mode, half, dp_mesh)
        if distiller is not None:
            logger.info("DISTILL.TYPE %s: %s", cfg.DISTILL.TYPE, distiller.note)
    groups = split_by_tensor_kind(param_groups(model, cfg))
    master = None
    if mode is AmpMode.O2 and not fsdp:
        master = MasterWeights(model.parameters())
        for g in groups:
            g["params"] = [master.master_for(p) for p in g["params"]]
    optimizer = construct_optimizer(groups, cfg)
    parts = Components(
        cfg=cfg,
        device=device,
        mode=mode,
        half_dtype=half,
        trained=trained,
        model=unwrap(trained),
        optimizer=optimizer,
        scaler=loss_scaler(half if mode is not AmpMode.FP32 else torch.float32),
        loss_fn=build_loss(cfg),
        distiller=distiller,
        spike_guard=build_spike_guard(cfg),
        master=master,
        ema=ema,
        opt_params=[p for g in groups for p in g["params"]],
        loaded=built.loaded,
        layout=layout,
        mesh=mesh,
        data_rank=data_rank,
        pipeline=built.pipeline,
        ema_pipeline=built.ema_pipeline,
        reports_metrics=tp_i == 0 and pp_i == layout.pp - 1,
        after_update=float8_scale_updater(model) if fp8_enabled(cfg) else None,
    )
    if layout.tp > 1:
        parts.tp_replicated = replicated_params(parts.model)
        parts.tp_group = mesh["tp"].get_group()
    dtype = input_dtype(mode, half)
    if "train" in (loaders or ()):
        parts.train_loader = construct_train_loader(cfg, data_rank, layout.dp)
        parts.train_prep = DeviceBatchTransform(cfg, device, dtype, True, data_rank)
        parts.train_batches = DevicePrefetcher(parts.train_loader, parts.train_prep)
    if "test" in (loaders or ()):
        parts.attach_test_loader(cfg)
    return parts
