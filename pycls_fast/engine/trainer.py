"""The training loop: config -> components -> epochs -> logs, checkpoints, metrics.

    train_model(cfg)   # trains, evaluates every TRAIN.EVAL_PERIOD epochs; returns stats
    test_model(cfg)    # evaluates TEST.WEIGHTS; returns stats

Components are built by `build_components` from the config (model, precision,
parallel wrapper, optimizer, loss scaler, EMA, loaders, device-side batch preparation);
`train_epoch` and `test_epoch` own the inner loops. Every stats record goes to the log
as a pycls `json_stats` line. Under torch.distributed every rank runs the same loop on
its shard of the data; metrics are reduced across ranks and rank 0 writes the logs.
"""

import logging
import os
import random
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from yacs.config import CfgNode

from pycls_fast.checkpoint import CheckpointManager, files
from pycls_fast.checkpoint.remote import PULLED_MARKER, RemoteOut, mirror_dir
from pycls_fast.checkpoint.run_record import record_config
from pycls_fast.checkpoint.weights import (
    LoadedWeights,
    checkpoint_channel_order,
    resolve_start_weights,
)
from pycls_fast.components.ema import ema_alpha, update_ema
from pycls_fast.components.float8 import float8_scale_updater, fp8_enabled
from pycls_fast.components.losses import build_loss
from pycls_fast.components.meters import EpochMeter, memory_mb, topk_errors
from pycls_fast.components.optimizer import (
    construct_optimizer,
    lr_at,
    param_groups,
    schedule_warnings,
    set_lr,
    split_by_tensor_kind,
)
from pycls_fast.components.precision import (
    AmpMode,
    LossScaler,
    MasterWeights,
    apply_backend_flags,
    at_least_fp32,
    autocast,
    describe_precision,
    input_dtype,
    loss_scaler,
    resolve_amp,
    weight_cache,
)
from pycls_fast.components.spike_guard import SpikeGuard, build_spike_guard
from pycls_fast.config import train_stage, with_overrides
from pycls_fast.datasets.loader import (
    ImageLoader,
    construct_test_loader,
    construct_train_loader,
)
from pycls_fast.datasets.to_device.prefetch import DevicePrefetcher
from pycls_fast.datasets.to_device.transform import DeviceBatchTransform
from pycls_fast.engine.distill import Distiller, build_distiller
from pycls_fast.engine.model_setup import build_model_parts
from pycls_fast.engine.precise_bn import update_precise_bn
from pycls_fast.engine.run_metrics import RunMetrics
from pycls_fast.errors import (
    NonFiniteLossError,
    OutDirInUseError,
    UserError,
)
from pycls_fast.observe.logging import format_eta, log_json_stats, setup_logging
from pycls_fast.observe.profiling import StepProfiler
from pycls_fast.observe.stats_sinks import attach_stats_sinks
from pycls_fast.parallel.data_parallel import (
    fsdp_enabled,
    sharded_checkpoints,
    unwrap,
)
from pycls_fast.parallel.mesh import Layout, build_mesh
from pycls_fast.parallel.pipeline import (
    PipelineRunner,
)
from pycls_fast.parallel.planner import auto_layout, device_gib
from pycls_fast.parallel.tensor_parallel import (
    clip_grad_norm_,
    grad_norm,
)
from pycls_fast.runtime import distributed
from pycls_fast.runtime.device_info import describe_device, outdated_warning
from pycls_fast.runtime.preemption import StopRequest
from pycls_fast.runtime.run_lock import RunLock
from pycls_fast.storage import is_remote

logger = logging.getLogger(__name__)


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


def seed_everything(seed):
    """Seeds Python, numpy and torch: CPU runs are then bit-for-bit reproducible."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def setup_run(cfg):
    """Creates OUT_DIR (checking it is writable), sets up logging and the backend
    flags (TF32, cuDNN autotuning), and logs where and on what the run goes."""
    prepare_out_dir(cfg)
    setup_logging(cfg.OUT_DIR, cfg.LOG_DEST, distributed.is_main())
    if distributed.is_main():
        attach_stats_sinks(
            cfg.OUT_DIR,
            tensorboard=cfg.LOG_TENSORBOARD,
            wandb_cfg=cfg if cfg.LOG_WANDB else None,
        )
    apply_backend_flags(cfg)
    outdated = outdated_warning()
    if outdated and distributed.is_main():
        logger.warning("warning: %s", outdated)
    logger.info(
        "output folder %s; device %s; %d process(es)",
        os.path.abspath(cfg.OUT_DIR),
        describe_device(distributed.device()),
        distributed.world_size(),
    )


def prepare_out_dir(cfg):
    """Creates OUT_DIR; UserError naming it when it cannot be written to."""
    try:
        os.makedirs(cfg.OUT_DIR, exist_ok=True)
        probe = os.path.join(cfg.OUT_DIR, f".write_test.{os.getpid()}")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as e:
        raise UserError(
            f"OUT_DIR {cfg.OUT_DIR} is not writable: {e.strerror}"
        ) from None


def lock_out_dir(cfg):
    """Takes OUT_DIR's lock on rank 0 (every rank stops if another training holds
    it) and clears what interrupted checkpoint writes left; returns the lock."""
    lock, error = None, None
    if distributed.is_main():
        try:
            lock = RunLock(cfg.OUT_DIR).acquire()
        except OutDirInUseError as e:
            error = str(e)
        else:
            files.remove_partial(cfg.OUT_DIR)
    error = distributed.broadcast_object(error)
    if error:
        raise OutDirInUseError(error)
    return lock


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
        distiller = build_distiller(cfg, device, mode, half)
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
    dtype = input_dtype(mode, half)
    if "train" in (loaders or ()):
        parts.train_loader = construct_train_loader(cfg, data_rank, layout.dp)
        parts.train_prep = DeviceBatchTransform(cfg, device, dtype, True, data_rank)
        parts.train_batches = DevicePrefetcher(parts.train_loader, parts.train_prep)
    if "test" in (loaders or ()):
        parts.attach_test_loader(cfg)
    return parts


def _gradient_sync(model, enabled):
    """Turns the gradient reduction of DDP or FSDP2 on or off for the next backward
    (DDP's `require_backward_grad_sync`, which its `no_sync()` sets; FSDP2's
    `set_requires_gradient_sync`); a plain module has none."""
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(enabled)
    elif hasattr(model, "require_backward_grad_sync"):
        model.require_backward_grad_sync = enabled


def forward_backward(parts, inputs, targets, weight=1.0):
    """Forward and backward of the batch in TRAIN.ACCUM_STEPS micro-batches, each
    loss weighted by its share of the batch (their sum is the batch's mean loss;
    the gradients add up to the whole batch's); returns (loss, logits) detached."""
    if parts.pipeline is not None:
        return _pipeline_forward_backward(parts, inputs, targets, weight)
    steps = parts.cfg.TRAIN.ACCUM_STEPS
    chunks = list(zip(inputs.chunk(steps), targets.chunk(steps)))
    losses, all_logits = [], []
    for i, (x, y) in enumerate(chunks):
        last = i == len(chunks) - 1
        if len(chunks) > 1:
            _gradient_sync(parts.trained, last)  # one reduction, after the last
        with parts.autocast():
            out = parts.trained(x)
            teacher = parts.distiller.teacher_logits(x) if parts.distiller else None
        share = len(y) / len(targets)
        if parts.distiller is not None:
            loss = parts.distiller.loss(parts.loss_fn, out, teacher, y) * share
        else:
            loss = parts.loss_fn(at_least_fp32(out), y) * share
        logits = mean_logits(out)
        parts.scaler.scale(loss * weight if weight != 1.0 else loss).backward()
        losses.append(loss.detach())
        all_logits.append(logits.detach())
    if len(chunks) == 1:
        return losses[0], all_logits[0]
    return torch.stack(losses).sum(), torch.cat(all_logits)


def _pipeline_forward_backward(parts, inputs, targets, weight):
    """The pipeline's forward and backward of the batch (its micro-batches are the
    accumulation); the loss is shared from the last stage with the others, so that
    every rank sees a non-finite loss. Returns (loss, logits) detached; the logits
    are zeros on ranks without the last stage (they count no images)."""
    n = len(targets)
    full = parts.cfg.TRAIN.BATCH_SIZE // parts.layout.dp
    if n < full:
        # A batch short of its bad images: a pipeline's shapes are fixed, so its
        # own images fill it, repeated (they weigh a little more in this step).
        fill = torch.arange(full, device=targets.device) % n
        inputs, targets = inputs[fill], targets[fill]
    unscaled = []

    def loss_fn(out, y):
        loss = parts.loss_fn(at_least_fp32(out), y)
        unscaled.append(loss.detach())
        return parts.scaler.scale(loss * weight if weight != 1.0 else loss)

    with parts.autocast():
        _, logits = parts.pipeline.train(inputs, targets, loss_fn)
    # The micro-batches' losses are the last calls: a stage's first step also calls
    # the loss on the shapes it infers.
    unscaled = unscaled[-parts.pipeline.n_micro :]
    zero = torch.zeros((), device=parts.device)
    loss = torch.stack(unscaled).mean() if unscaled else zero
    dist.all_reduce(loss, group=parts.pipeline.group)  # 0 from the other stages
    if logits is None:
        classes = parts.cfg.MODEL.NUM_CLASSES
        logits = torch.zeros(n, classes, device=parts.device)
    return loss, logits[:n]


def mean_logits(out):
    """The logits of a forward: the mean of the two heads' when a distillation-token
    model returns (class logits, distillation logits) in training (as it does in
    eval), else `out`."""
    return (out[0] + out[1]) / 2 if isinstance(out, tuple) else out


def train_step(parts, inputs, targets, weight=1.0):
    """One optimization step; returns (loss tensor, logits, found_inf).

    inputs: (B, 3, H, W) in the input dtype; targets: (B,) int64 or (B, classes)
    soft targets; with TRAIN.ACCUM_STEPS > 1 they are run in that many micro-batches
    before the step. `weight` scales the loss that is backpropagated (0: this rank
    only takes part in the collectives). found_inf: fp16 loss scaling's overflow
    flag, a 0-d float32 device tensor (1.0: the step was skipped), else None.
    Nothing is read back to the host (fp16 with a non-fused optimizer reads the
    flag)."""
    loss, logits = forward_backward(parts, inputs, targets, weight)
    if parts.master is not None:
        parts.master.grads_to_master()
    # The overflow flag is reduced over every rank (an overflow in any stage or
    # shard skips the step in all of them).
    found_inf = parts.scaler.unscale_(parts.opt_params)
    stages = parts.pipeline.group if parts.pipeline is not None else None
    skip = found_inf
    if parts.spike_guard is not None:
        spike = parts.spike_guard.check(loss, judge=weight != 0)
        skip = spike if found_inf is None else torch.maximum(found_inf, spike)
    if parts.cfg.OPTIM.GRAD_CLIP > 0:
        # After an overflow the clipped grads are NaN too; the step is skipped.
        norm = clip_grad_norm_(parts.opt_params, parts.cfg.OPTIM.GRAD_CLIP, stages)
    else:
        norm = grad_norm(parts.opt_params, stages)
    parts.grad_norm = norm.detach()
    if parts.before_update is not None:
        parts.before_update()  # e.g. a checkpoint's copy of the weights must be done
    if parts.scaler.step(parts.optimizer, skip) and parts.master is not None:
        parts.master.master_to_model()  # unchanged masters after a skipped step
    parts.scaler.update(found_inf)
    if parts.after_update is not None:
        parts.after_update()
    parts.optimizer.zero_grad(set_to_none=True)
    return loss, logits, found_inf


def _step_without_images(parts):
    """A training batch whose images all failed to decode (the loader yields it empty
    to keep ranks in step). One process skips the step. Under several processes this
    rank joins the others' step with a blank image weighted zero, so that DDP's and
    FSDP's collectives line up and the replicas stay equal."""
    if distributed.world_size() == 1:
        return
    size = parts.train_loader.decoder.shape[0]  # this epoch's (size schedule)
    dtype = input_dtype(parts.mode, parts.half_dtype)
    # One image per micro-batch: as many forwards (FSDP's gathers) as the others;
    # a pipeline takes its fixed batch.
    n = parts.cfg.TRAIN.ACCUM_STEPS
    if parts.pipeline is not None:
        n = parts.cfg.TRAIN.BATCH_SIZE // parts.layout.dp
    blank = torch.zeros(n, 3, size, size, dtype=dtype, device=parts.device)
    label = torch.zeros(n, dtype=torch.long, device=parts.device)
    train_step(parts, blank, label, weight=0.0)


def _spike_skipped(parts, epoch, it):
    """Whether the spike guard skipped this step (logged; its loss is kept out of
    the epoch's meter). False when the guard is off."""
    if parts.spike_guard is None:
        return False
    where = f"epoch {epoch + 1}, iteration {it + 1}"
    return parts.spike_guard.record(
        where, lambda: files.last_checkpoint(parts.cfg.OUT_DIR) or "none yet"
    )


def check_finite(parts, meter, epoch):
    """Raises NonFiniteLossError when `meter` has seen a non-finite loss since its
    reset (reads it from the device: at log steps, before checkpoints, at the end
    of the epoch). fp16 loss scaling handles overflow itself, by skipping steps."""
    if parts.scaler.enabled:
        return
    bad = meter.first_non_finite()
    if bad is None:
        return
    it, loss_value = bad
    last = files.last_checkpoint(parts.cfg.OUT_DIR) or "none yet"
    hint = "lower OPTIM.BASE_LR"
    if parts.half_dtype == torch.float16 and parts.mode is not AmpMode.FP32:
        hint += ", or use AMP.DTYPE bf16"
    raise NonFiniteLossError(
        f"loss is {loss_value} at epoch {epoch + 1}, iteration {it + 1}; last good "
        f"checkpoint: {last}; try: {hint}"
    )


def _progress(total, enabled):
    """A tqdm bar when stdout is a terminal (main process), else None."""
    if not (enabled and sys.stdout.isatty()):
        return None
    from tqdm import tqdm

    # On stdout, with the log lines (observe/logging.py writes them around the bar).
    return tqdm(total=total, leave=False, dynamic_ncols=True, file=sys.stdout)


def _log_stage(cfg, epoch, first):
    """A line when a TRAIN.SIZE_SCHEDULE stage starts (and where a run starts)."""
    stages = cfg.TRAIN.SIZE_SCHEDULE
    if not stages:
        return
    starts = [s[0] for s in stages]
    if first or epoch in starts:
        size, batch = train_stage(cfg, epoch)
        index = sum(1 for s in starts if s <= epoch)
        logger.info(
            f"resolution stage {index}/{len(stages)} from epoch {epoch + 1}: "
            f"{size} px, batch {batch}"
        )


def train_epoch(parts, epoch, start_iter=0, on_iter_end=None):
    """Trains one epoch (from `start_iter`); returns its train_epoch stats record.

    A step reads nothing back from the device (no host sync) unless a log line, a
    checkpoint or the preemption check is due: losses and errors are summed on the
    device and read at LOG_PERIOD (docs/PERFORMANCE.md, "Host syncs")."""
    cfg, model = parts.cfg, parts.trained
    batches = parts.train_batches
    batches.set_epoch(epoch, start_batch=start_iter)
    iters = start_iter + len(batches)
    model.train()
    meter = parts.train_meter
    if start_iter == 0:
        meter.reset()  # else it holds the sums restored with the checkpoint
    bar = _progress(iters - start_iter, distributed.is_main())
    skipped_before = parts.scaler.skipped_steps
    lr = lr_at(cfg, epoch + start_iter / max(iters, 1))
    for it, (inputs, targets) in enumerate(batches, start=start_iter):
        lr = lr_at(cfg, epoch + it / iters)
        set_lr(parts.optimizer, lr)
        if len(targets):
            loss, logits, _ = train_step(parts, inputs, targets)
            if not _spike_skipped(parts, epoch, it):
                hard = targets.argmax(dim=1) if targets.ndim == 2 else targets
                top1, top5 = topk_errors(logits.float(), hard)
                n = len(hard) if parts.reports_metrics else 0
                meter.add(loss.detach(), top1, top5, n, step=it)
        else:
            _step_without_images(parts)
        if parts.ema is not None and (it + 1) % cfg.OPTIM.EMA_UPDATE_PERIOD == 0:
            # O2 without FSDP: the EMA follows the fp32 masters, not bf16 roundings.
            masters = parts.master.fp32_state(parts.model) if parts.master else None
            update_ema(parts.model, parts.ema, ema_alpha(cfg, epoch), masters)
        if bar is not None:
            bar.update(1)
        if (it + 1) % cfg.LOG_PERIOD == 0:
            check_finite(parts, meter, epoch)
            skipped = parts.scaler.skipped_steps - skipped_before
            record = _log_train_iter(parts, meter, epoch, it, iters, lr, skipped)
            if bar is not None:
                bar.set_postfix(loss=f"{record['loss']:.3f}", lr=f"{lr:.2e}")
        if on_iter_end is not None:
            on_iter_end(epoch, it + 1, iters)
    if bar is not None:
        bar.close()
    check_finite(parts, meter, epoch)
    skipped = parts.scaler.skipped_steps - skipped_before
    stats = meter.summary()
    data = batches.stats()
    record = {
        "_type": "train_epoch",
        "epoch": f"{epoch + 1}/{cfg.OPTIM.MAX_EPOCH}",
        "loss": stats["loss"],
        "top1_err": stats["top1_err"],
        "top5_err": stats["top5_err"],
        "lr": lr,
        "img_per_s": stats["img_per_s"],
        "data_wait_frac": data.get("data_wait_frac", 0.0),
        "bad_images": data.get("bad_images", 0),
        "skipped_steps": skipped,
        "loss_scale": parts.scaler.scale_value,
        "time_epoch_s": meter.elapsed(),
        "mem_mb": memory_mb(parts.device),
    }
    if parts.metrics is not None:
        record |= parts.metrics.step_fields(parts, stats["img_per_s"])
        record |= parts.metrics.goodput_fields(
            epoch, iters, data.get("data_wait_s", 0.0)
        )
    log_json_stats(record)
    return record


def _log_train_iter(parts, meter, epoch, it, iters, lr, skipped):
    cfg = parts.cfg
    elapsed = meter.elapsed()
    done = meter.iters
    per_iter = elapsed / max(done, 1)
    remaining = (iters - it - 1) + (cfg.OPTIM.MAX_EPOCH - epoch - 1) * iters
    data = parts.train_loader.stats()
    loss, top1, top5, images = distributed.all_reduce_sum(
        [*meter.sums(), float(meter.count)]
    )
    images = max(images, 1.0)
    record = {
        "_type": "train_iter",
        "epoch": f"{epoch + 1}/{cfg.OPTIM.MAX_EPOCH}",
        "iter": f"{it + 1}/{iters}",
        "loss": loss / images,
        "top1_err": top1 / images,
        "top5_err": top5 / images,
        "lr": lr,
        "img_per_s": images / max(elapsed, 1e-9),
        "data_wait_frac": data.get("data_wait_frac", 0.0),
        "skipped_steps": skipped,
        "eta": format_eta(per_iter * remaining),
        "mem_mb": memory_mb(parts.device),
    }
    if parts.metrics is not None:
        record |= parts.metrics.step_fields(parts, record["img_per_s"])
        parts.metrics.goodput_fields(epoch, it + 1, data.get("data_wait_s", 0.0))
    log_json_stats(record)
    return record


def eval_forward(parts, model, inputs, size=None):
    """`model`'s (parts.model's or parts.ema's) logits of `inputs`, through its
    pipeline under PARALLEL.PP: then None on the ranks before the last stage, and
    the batch is padded to `size` images (default: its own)."""
    runner = parts.ema_pipeline if model is parts.ema else parts.pipeline
    if runner is None:
        return model(inputs)
    return runner.evaluate(inputs, size or len(inputs))


def planned_forwards(parts):
    """FSDP: the most test batches any rank plans to run (every rank must run as
    many forwards: each gathers the parameters with collectives). Agreed on before
    the first forward: a reduction after the loop would meet a longer rank's
    all-gather and hang. None without FSDP."""
    if not fsdp_enabled(parts.cfg):
        return None
    return int(distributed.all_reduce_max([float(len(parts.test_loader))])[0])


def pad_sharded_forwards(parts, model, done, most):
    """FSDP: test shards may differ by one batch (and a batch of only bad images is
    not yielded); a rank that ran `done` forwards of the `most` (planned_forwards)
    runs the rest on a blank image, whose output is dropped."""
    if most is None:
        return
    size = parts.cfg.TRAIN.IM_SIZE
    dtype = input_dtype(parts.mode, parts.half_dtype)
    blank = torch.zeros(1, 3, size, size, dtype=dtype, device=parts.device)
    size = parts.cfg.TEST.BATCH_SIZE // parts.layout.dp
    for _ in range(most - done):
        with parts.autocast():
            eval_forward(parts, model, blank, size)


@torch.no_grad()
def test_epoch(
    parts, model, epoch, kind="test_epoch", label=None, extra=None, columns=None
):
    """Evaluates `model` on the test split; returns its stats record (`kind`) whose
    "epoch" is `label`, or "epoch + 1/OPTIM.MAX_EPOCH" without one; `extra` fields
    are added to it before it is logged. `columns`: the logits kept, in the order of
    the split's labels (a split of some of the model's classes: ImageNet-A, -R)."""
    cfg = parts.cfg
    model.eval()
    meter = EpochMeter()
    # The EMA is kept in fp32 (components/ema.py): under O3 it runs autocast like O2.
    mode = AmpMode.O2 if parts.mode is AmpMode.O3 and model is parts.ema else parts.mode
    size = cfg.TEST.BATCH_SIZE // parts.layout.dp
    most = planned_forwards(parts)
    for inputs, labels in parts.test_batches:
        if not len(labels):
            continue
        with parts.autocast(mode):
            logits = eval_forward(parts, model, inputs, size)
        if logits is None:  # a pipeline stage before the last: nothing to count
            meter.add(0.0, 0.0, 0.0, 0)
            continue
        if columns is not None:
            logits = logits[:, columns]
        loss = F.cross_entropy(logits.float(), labels)
        top1, top5 = topk_errors(logits.float(), labels)
        meter.add(loss, top1, top5, len(labels) if parts.reports_metrics else 0)
    pad_sharded_forwards(parts, model, meter.iters, most)
    stats = meter.summary()
    record = {
        "_type": kind,
        "epoch": label or f"{epoch + 1}/{cfg.OPTIM.MAX_EPOCH}",
        "loss": stats["loss"],
        "top1_err": stats["top1_err"],
        "top5_err": stats["top5_err"],
        "images": stats["images"],
        "img_per_s": stats["img_per_s"],
        "time_epoch_s": meter.elapsed(),
        "mem_mb": memory_mb(parts.device),
        **(extra or {}),
    }
    log_json_stats(record)
    return record


def train_model(cfg):
    """Trains per the config; returns the last {train, test[, test_ema]} records.

    Run it on every rank of a job (`distributed.launch` starts them). One training
    per OUT_DIR at a time. SIGTERM / SIGINT stop it at the next iteration boundary
    with a checkpoint (raising `Stopped`); rerunning resumes from it."""
    remote = None
    if is_remote(cfg.OUT_DIR):
        # Training works in a local mirror; checkpoints and logs go up from there.
        local = mirror_dir(cfg.OUT_DIR, cfg.OUT_MIRROR)
        remote = RemoteOut(cfg.OUT_DIR, local, cfg.TRAIN.CHECKPOINT_KEEP)
        # The same config on every rank, the URL compared (mirrors may differ by
        # node: each node's own temporary folder).
        distributed.check_same_config(cfg)
        pull_on_each_node(remote)
        cfg = with_overrides(cfg, {"OUT_DIR": local})
    else:
        distributed.check_same_config(cfg)
    prepare_out_dir(cfg)
    lock = lock_out_dir(cfg)
    try:
        with StopRequest() as stop:
            return _train(cfg, stop, remote)
    finally:
        if lock is not None:
            lock.release()
        if remote is not None and distributed.is_main():
            remote.push()  # the logs of a run that ends, stops or fails


def pull_on_each_node(remote: RemoteOut) -> None:
    """Fills the mirror of every node from the store, once per mirror folder: rank
    0 pulls first (leaving a marker of this job), then the first rank of each node
    that does not see the marker (a node-local mirror) pulls its own. Nodes that
    share rank 0's mirror (a shared file system) neither pull again nor collide on
    its lock."""
    token = distributed.broadcast_object(uuid.uuid4().hex)
    marker = os.path.join(remote.local, f"{PULLED_MARKER}{token}")
    if distributed.is_main():
        _pull(remote)
        open(marker, "w").close()  # noqa: SIM115 - an empty marker
    distributed.barrier()
    if (
        not distributed.is_main()
        and distributed.local_rank() == 0
        and not os.path.exists(marker)
    ):
        _pull(remote)
    distributed.barrier()
    if distributed.is_main():
        os.remove(marker)


def _pull(remote):
    os.makedirs(remote.local, exist_ok=True)
    with RunLock(remote.local):  # two runs on one node do not fill one mirror
        remote.pull()


def resolve_channel_order(cfg: CfgNode, weights: str) -> CfgNode:
    """DATA.CHANNEL_ORDER 'auto' made 'rgb' or 'bgr': what the checkpoint `weights`
    expects (a pycls checkpoint: pycls's BGR; a pycls_fast one: its saved order),
    else 'rgb'; logs the choice. An explicit order is kept."""
    if cfg.DATA.CHANNEL_ORDER != "auto":
        return cfg
    found = checkpoint_channel_order(weights) if weights else None
    order, why = found or ("rgb", "no checkpoint says otherwise")
    logger.info("DATA.CHANNEL_ORDER auto: %s (%s)", order, why)
    return with_overrides(cfg, {"DATA.CHANNEL_ORDER": order})


def _upload_checkpoint(cfg, remote, path):
    """Uploads the checkpoint just written at `path` (rank 0's; None elsewhere): a
    sharded one (FSDP, TP or PP: sharded_checkpoints) by every rank, its own part,
    then completed by rank 0."""
    if sharded_checkpoints(cfg):
        # Each node's own copy: mirrors may be node-local, at other paths.
        name = os.path.basename(distributed.broadcast_object(path))
        path = os.path.join(files.checkpoint_dir(remote.local), name)
        remote.push_checkpoint(path, distributed.rank(), distributed.is_main())
        distributed.barrier()
        if distributed.is_main():
            remote.finish_checkpoint(path)
    elif distributed.is_main():
        remote.push_checkpoint(path)


def _train(cfg, stop, remote=None):
    setup_run(cfg)
    if remote is not None:
        logger.info(
            "OUT_DIR %s through the local mirror %s; fetched checkpoints: %s",
            remote.url,
            remote.local,
            ", ".join(remote.fetched) or "none",
        )
    cfg = resolve_start_weights(cfg)  # a run folder: its newest checkpoint
    cfg = resolve_channel_order(cfg, cfg.TRAIN.WEIGHTS)
    if cfg.PARALLEL.AUTO:
        # Rank 0's memory for all: every rank must plan the same layout.
        gib = device_gib(distributed.device(), distributed.local_world_size())
        cfg, table = auto_layout(cfg, distributed.broadcast_object(gib))
        logger.info("%s", table)
    seed_everything(cfg.RNG_SEED)
    parts = build_components(cfg)
    logger.info(
        "model: %s params; precision %s; %s; %d train and %d test batches per "
        "epoch and rank",
        f"{sum(p.numel() for p in parts.model.parameters()):,}",
        describe_precision(parts.mode, parts.half_dtype),
        _parallel_name(cfg),
        len(parts.train_loader),
        len(parts.test_loader),
    )
    logger.info(
        "batch %d images per step (TRAIN.BATCH_SIZE), %d per data-parallel rank; "
        "%d epoch(s); lr OPTIM.BASE_LR %g as given (not scaled by the batch size "
        "or NUM_GPUS)",
        cfg.TRAIN.BATCH_SIZE,
        cfg.TRAIN.BATCH_SIZE // parts.layout.dp,
        cfg.OPTIM.MAX_EPOCH,
        cfg.OPTIM.BASE_LR,
    )
    for warning in schedule_warnings(cfg):
        logger.warning("warning: %s", warning)

    parts.metrics = metrics = RunMetrics(
        cfg, parts, len(parts.train_loader), distributed.is_main()
    )

    def before_save(epoch, iteration):
        # No checkpoint of weights that a non-finite loss has already touched; the
        # position (E, 0) is the end of epoch E - 1.
        check_finite(parts, parts.train_meter, epoch if iteration else epoch - 1)
        metrics.mark(epoch, iteration)

    after_save = None
    if remote is not None:

        def after_save(path):
            _upload_checkpoint(cfg, remote, path)

    manager = CheckpointManager(
        parts,
        before_save=before_save,
        after_save=after_save,
        stall_timer=lambda: metrics.span("checkpoint"),
    )
    parts.before_update = manager.wait_staged
    start_epoch, start_iter = manager.restore()
    metrics.resumed_at(start_epoch, start_iter)
    if distributed.is_main():
        # Only now: a run that fails to start leaves the previous config.yaml as it
        # was; one that changes it keeps the old one in config_history/.
        record_config(cfg)

    # The stop signal is agreed on (a collective and a host read) every
    # TRAIN.PREEMPT_CHECK_PERIOD steps and at the end of each epoch; in one process
    # it costs nothing and is checked after every step.
    one = distributed.world_size() == 1
    check_period = 1 if one else cfg.TRAIN.PREEMPT_CHECK_PERIOD

    profiler = StepProfiler(cfg, distributed.rank(), parts.device)

    def on_iter_end(epoch, done, iters):
        profiler.step()
        due = done % check_period == 0 or done == iters
        manager.after_iteration(epoch, done, iters, stop.agreed() if due else 0)

    results = {}
    if start_epoch >= cfg.OPTIM.MAX_EPOCH:
        logger.info("all %d epochs are done: evaluating the final weights", start_epoch)
        results["test"] = test_epoch(parts, parts.model, start_epoch - 1)
        if parts.ema is not None:
            results["test_ema"] = test_epoch(
                parts, parts.ema, start_epoch - 1, "test_ema_epoch"
            )
    try:
        _epochs(parts, manager, results, start_epoch, start_iter, on_iter_end, remote)
    except BaseException:
        manager.close(failed=True)  # no exit before the last write is complete
        raise
    else:
        manager.close()
    finally:
        profiler.close()
        metrics.finish()
    return results


def _epochs(parts, manager, results, start_epoch, start_iter, on_iter_end, remote):
    """Trains and evaluates epochs start_epoch..OPTIM.MAX_EPOCH - 1 into `results`."""
    cfg = parts.cfg
    for epoch in range(start_epoch, cfg.OPTIM.MAX_EPOCH):
        t0 = time.perf_counter()
        _log_stage(cfg, epoch, first=epoch == start_epoch)
        with parts.metrics.span("train"):
            results["train"] = train_epoch(parts, epoch, start_iter, on_iter_end)
        start_iter = 0
        if cfg.BN.USE_PRECISE_STATS:  # before the epoch's checkpoint (pycls's order)
            update_precise_bn(parts, epoch)
        last_epoch = epoch + 1 == cfg.OPTIM.MAX_EPOCH
        manager.after_epoch(epoch)
        if (epoch + 1) % cfg.TRAIN.EVAL_PERIOD == 0 or last_epoch:
            with parts.metrics.span("eval"):
                results["test"] = test_epoch(parts, parts.model, epoch)
            manager.after_eval(epoch, results["test"]["top1_err"])
            if parts.ema is not None:
                with parts.metrics.span("eval"):
                    results["test_ema"] = test_epoch(
                        parts, parts.ema, epoch, "test_ema_epoch"
                    )
        logger.info("epoch %d done in %.1f s", epoch + 1, time.perf_counter() - t0)
        if remote is not None and distributed.is_main():
            remote.push()


def prepare_test(cfg):
    """Sets up an evaluation run (output folder, logging, seeds) and finds the
    checkpoint TEST.WEIGHTS names; returns (cfg with the channel order resolved,
    checkpoint path)."""
    setup_run(cfg)
    distributed.check_same_config(cfg)
    seed_everything(cfg.RNG_SEED)
    if not cfg.TEST.WEIGHTS:
        raise UserError(
            "TEST.WEIGHTS is empty: name the checkpoint to evaluate, or evaluate a "
            "run's newest checkpoint with --run OUT_DIR"
        )
    path, how = files.resolve_weights(cfg.TEST.WEIGHTS)
    if how != "given":
        logger.info("TEST.WEIGHTS %s: %s", cfg.TEST.WEIGHTS, how)
    return resolve_channel_order(cfg, path), path


def test_model(cfg):
    """Evaluates TEST.WEIGHTS (a checkpoint file or sharded directory) on the test
    split, on every rank of the job; returns the test_epoch record."""
    cfg, path = prepare_test(cfg)
    # Loaded before wrapping or sharding; load_state_dict copies into the model as
    # built, in its dtypes.
    parts = build_components(
        cfg, loaders=("test",), weights=path, use_ema=cfg.TEST.USE_EMA
    )
    label = checkpoint_epoch_label(parts.loaded, cfg.OPTIM.MAX_EPOCH)
    if parts.loaded.epoch is None:
        logger.info("evaluating weights that do not say their epoch (%s)", label)
    else:
        logger.info("evaluating the weights of epoch %s", label)
    return test_epoch(parts, parts.model, 0, label=label)


def checkpoint_epoch_label(loaded, max_epoch):
    """The test record's "epoch" of loaded weights: "E/MAX_EPOCH" after E completed
    epochs, "E+1/MAX_EPOCH" for a checkpoint taken during epoch E+1, "0/MAX_EPOCH"
    for weights that do not say (converted files)."""
    if loaded is None or loaded.epoch is None:
        return f"0/{max_epoch}"
    epoch = loaded.epoch + (1 if loaded.iteration else 0)
    return f"{epoch}/{max_epoch}"


def _parallel_name(cfg):
    world = distributed.world_size()
    layout = Layout.from_cfg(cfg, world)
    if layout.model_parallel:
        dp = "FSDP" if fsdp_enabled(cfg) else "DDP"
        return f"{layout.describe()} ({dp} over DP) on {world} processes"
    if fsdp_enabled(cfg):
        return f"FSDP over {world} process(es)"
    return f"DDP over {world} processes" if world > 1 else "one process"
