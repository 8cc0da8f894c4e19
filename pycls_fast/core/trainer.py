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
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch.distributed.checkpoint.api import CheckpointException

from pycls_fast.config import dump_cfg
from pycls_fast.core import checkpoint as ckpt
from pycls_fast.core import distributed
from pycls_fast.core import sharded_checkpoint as sharded
from pycls_fast.core.ema import create_ema, ema_alpha, ema_enabled, update_ema
from pycls_fast.core.logging import format_eta, log_json_stats, setup_logging
from pycls_fast.core.meters import EpochMeter, memory_mb, topk_errors
from pycls_fast.core.optimizer import construct_optimizer, lr_at, param_groups, set_lr
from pycls_fast.core.parallel import fsdp_enabled, parallelize, shard_model, unwrap
from pycls_fast.core.precision import (
    AmpMode,
    MasterWeights,
    autocast,
    describe_precision,
    input_dtype,
    loss_scaler,
    prepare_model,
    resolve_amp,
)
from pycls_fast.core.preemption import StopRequest, stop_message
from pycls_fast.core.run_lock import RunLock
from pycls_fast.datasets.device import DeviceBatchTransform
from pycls_fast.datasets.loader import construct_test_loader, construct_train_loader
from pycls_fast.errors import (
    CheckpointError,
    NonFiniteLossError,
    OutDirInUseError,
    Stopped,
    UserError,
)
from pycls_fast.models import build_model

logger = logging.getLogger(__name__)


@dataclass
class Components:
    """Everything a training run is made of (built once, from the config)."""

    cfg: object
    device: torch.device
    mode: AmpMode
    half: torch.dtype
    # The module trained (a DDP wrapper, or the model sharded in place by FSDP) and
    # the model inside it (evaluated, updated into the EMA, saved).
    model: torch.nn.Module
    module: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scaler: object
    master: MasterWeights | None = None
    ema: torch.nn.Module | None = None
    train_loader: object = None
    test_loader: object = None
    train_prep: DeviceBatchTransform | None = None
    test_prep: DeviceBatchTransform | None = None
    # The optimizer's parameters (fp32 masters under O2), for unscaling and clipping.
    opt_params: list = field(default_factory=list)


def seed_everything(seed):
    """Seeds Python, numpy and torch: CPU runs are then bit-for-bit reproducible."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def setup_run(cfg):
    """Creates OUT_DIR (checking it is writable) and sets up logging."""
    prepare_out_dir(cfg)
    setup_logging(cfg.OUT_DIR, cfg.LOG_DEST, distributed.is_main())
    if torch.cuda.is_available():
        torch.backends.cudnn.benchmark = cfg.CUDNN.BENCHMARK


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
            ckpt.remove_partial(cfg.OUT_DIR)
    error = distributed.broadcast_object(error)
    if error:
        raise OutDirInUseError(error)
    return lock


def build_components(
    cfg, *, loaders=("train", "test"), weights=None, use_ema=False, model=None
):
    """Builds the model, precision, parallel wrapper, optimizer, scaler, EMA and the
    loaders (and their device-side batch preparation) of the splits named in
    `loaders`. `weights`: a checkpoint to load into the model before it is wrapped
    (its EMA weights with `use_ema`). `model`: another nn.Module to train in place of
    the config's (e.g. a peer implementation in benchmarks)."""
    device = distributed.device()
    mode, half = resolve_amp(cfg)
    if model is None:
        model = build_model(cfg)
        if cfg.TRAIN.WEIGHTS:
            ckpt.load_model_weights(model, cfg.TRAIN.WEIGHTS, allow_missing_head=True)
    if weights:
        ckpt.load_model_weights(model, weights, use_ema=use_ema)
    model.to(device)
    fsdp = fsdp_enabled(cfg)
    if not (fsdp and mode is AmpMode.O2):
        # FSDP O2 keeps fp32 shards (the master weights) and casts when gathering.
        prepare_model(model, mode, half, cfg.AMP.LAYER_NORM_FP32)
    ema = create_ema(model) if ema_enabled(cfg) else None
    if ema is not None and fsdp:
        shard_model(ema, cfg, mode, half)  # sharded like the model
    trained = parallelize(model, cfg, mode, half, device)
    groups = param_groups(model, cfg)
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
        half=half,
        model=trained,
        module=unwrap(trained),
        optimizer=optimizer,
        scaler=loss_scaler(half if mode is not AmpMode.FP32 else torch.float32),
        master=master,
        ema=ema,
        opt_params=[p for g in groups for p in g["params"]],
    )
    dtype, rank = input_dtype(mode, half), distributed.rank()
    if "train" in (loaders or ()):
        parts.train_loader = construct_train_loader(cfg)
        parts.train_prep = DeviceBatchTransform(cfg, device, dtype, True, rank)
    if "test" in (loaders or ()):
        parts.test_loader = construct_test_loader(cfg)
        parts.test_prep = DeviceBatchTransform(cfg, device, dtype, False, rank)
    return parts


def train_step(parts, inputs, targets, weight=1.0):
    """One optimization step; returns (loss tensor, logits, step_skipped).

    inputs: (B, 3, H, W) in the input dtype; targets: (B,) int64 or (B, classes)
    soft targets. `weight` scales the loss that is backpropagated (0: this rank only
    takes part in the collectives)."""
    with autocast(parts.device.type, parts.mode, parts.half):
        logits = parts.model(inputs)
    loss = F.cross_entropy(logits.float(), targets)
    parts.scaler.scale(loss * weight if weight != 1.0 else loss).backward()
    if parts.master is not None:
        parts.master.grads_to_master()
    found_inf = parts.scaler.unscale_(parts.opt_params)
    if parts.cfg.OPTIM.GRAD_CLIP > 0 and not found_inf:
        torch.nn.utils.clip_grad_norm_(parts.opt_params, parts.cfg.OPTIM.GRAD_CLIP)
    if not found_inf:
        parts.optimizer.step()
        if parts.master is not None:
            parts.master.master_to_model()
    parts.scaler.update(found_inf)
    parts.optimizer.zero_grad(set_to_none=True)
    return loss.detach(), logits.detach(), found_inf


def _step_without_images(parts):
    """A training batch whose images all failed to decode (the loader yields it empty
    to keep ranks in step). One process skips the step. Under several processes this
    rank joins the others' step with a blank image weighted zero, so that DDP's and
    FSDP's collectives line up and the replicas stay equal. Returns found_inf."""
    if distributed.world_size() == 1:
        return False
    size = parts.cfg.TRAIN.IM_SIZE
    dtype = input_dtype(parts.mode, parts.half)
    blank = torch.zeros(1, 3, size, size, dtype=dtype, device=parts.device)
    label = torch.zeros(1, dtype=torch.long, device=parts.device)
    return train_step(parts, blank, label, weight=0.0)[2]


def _check_finite(parts, loss_value, epoch, it):
    if math.isfinite(loss_value) or parts.scaler.enabled:
        return  # fp16 loss scaling handles overflow by skipping the step
    last = ckpt.last_checkpoint(parts.cfg.OUT_DIR) or "none yet"
    hint = "lower OPTIM.BASE_LR"
    if parts.half == torch.float16 and parts.mode is not AmpMode.FP32:
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

    return tqdm(total=total, leave=False, dynamic_ncols=True)


def train_epoch(parts, epoch, start_iter=0, on_iter_end=None):
    """Trains one epoch (from `start_iter`); returns its train_epoch stats record."""
    cfg, model = parts.cfg, parts.model
    loader = parts.train_loader
    loader.set_epoch(epoch, start_batch=start_iter)
    iters = start_iter + len(loader)
    model.train()
    meter = EpochMeter()
    bar = _progress(iters - start_iter, distributed.is_main())
    skipped, lr = 0, lr_at(cfg, epoch + start_iter / max(iters, 1))
    for it, (images, labels) in enumerate(loader, start=start_iter):
        lr = lr_at(cfg, epoch + it / iters)
        set_lr(parts.optimizer, lr)
        if len(labels):
            inputs, targets = parts.train_prep(images, labels)
            loss, logits, found_inf = train_step(parts, inputs, targets)
            hard = targets.argmax(dim=1) if targets.ndim == 2 else targets
            top1, top5 = topk_errors(logits.float(), hard)
            loss_value = loss.item()
            _check_finite(parts, loss_value, epoch, it)
            meter.add(loss_value, top1, top5, len(hard))
        else:
            loss_value, found_inf = float("nan"), _step_without_images(parts)
        skipped += int(found_inf)
        if parts.ema is not None and (it + 1) % cfg.OPTIM.EMA_UPDATE_PERIOD == 0:
            update_ema(parts.module, parts.ema, ema_alpha(cfg, epoch))
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss_value:.3f}", lr=f"{lr:.2e}")
        if (it + 1) % cfg.LOG_PERIOD == 0:
            _log_train_iter(parts, meter, epoch, it, iters, lr, skipped)
        if on_iter_end is not None:
            on_iter_end(epoch, it + 1, iters)
    if bar is not None:
        bar.close()
    stats = meter.summary()
    data = loader.stats()
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
        [meter.loss_sum, meter.top1_sum, meter.top5_sum, float(meter.count)]
    )
    images = max(images, 1.0)
    log_json_stats(
        {
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
    )


def _pad_sharded_forwards(parts, model, done):
    """FSDP: every rank must run as many forwards as the others (each gathers the
    parameters with collectives), but test shards may differ by one batch; ranks
    short of the most run forwards on a blank image, whose output is dropped."""
    if not fsdp_enabled(parts.cfg):
        return
    most = int(distributed.all_reduce_max([float(done)])[0])
    size = parts.cfg.TRAIN.IM_SIZE
    dtype = input_dtype(parts.mode, parts.half)
    blank = torch.zeros(1, 3, size, size, dtype=dtype, device=parts.device)
    for _ in range(most - done):
        with autocast(parts.device.type, parts.mode, parts.half):
            model(blank)


@torch.no_grad()
def test_epoch(parts, model, epoch, kind="test_epoch"):
    """Evaluates `model` on the test split; returns its stats record (`kind`)."""
    cfg = parts.cfg
    model.eval()
    meter = EpochMeter()
    for images, labels in parts.test_loader:
        inputs, labels = parts.test_prep(images, labels)
        with autocast(parts.device.type, parts.mode, parts.half):
            logits = model(inputs)
        loss = F.cross_entropy(logits.float(), labels)
        top1, top5 = topk_errors(logits.float(), labels)
        meter.add(loss.item(), top1, top5, len(labels))
    _pad_sharded_forwards(parts, model, meter.iters)
    stats = meter.summary()
    record = {
        "_type": kind,
        "epoch": f"{epoch + 1}/{cfg.OPTIM.MAX_EPOCH}",
        "loss": stats["loss"],
        "top1_err": stats["top1_err"],
        "top5_err": stats["top5_err"],
        "images": stats["images"],
        "img_per_s": stats["img_per_s"],
        "time_epoch_s": meter.elapsed(),
        "mem_mb": memory_mb(parts.device),
    }
    log_json_stats(record)
    return record


def _meta(parts, epoch, iteration):
    """What every rank shares in a checkpoint: position, loss scale, config."""
    return {
        "epoch": epoch,
        "iter": iteration,
        "scaler_state": parts.scaler.state_dict(),
        "cfg": parts.cfg.dump(),
    }


def _rank_state(parts):
    """What each rank has of its own: the RNG states (global and device batches)."""
    state = {"rng_state": ckpt.rng_state()}
    if parts.train_prep is not None:
        state["batch_rng_state"] = {
            "numpy": parts.train_prep.rng.bit_generator.state,
            "torch": parts.train_prep.generator.get_state(),
        }
    return state


def training_state(parts, epoch, iteration):
    """The single-file checkpoint dict of a run at (epoch, iteration into it). Under
    DDP it holds every rank's RNG states (`rank_states`), gathered on all ranks."""
    rank_states = distributed.all_gather_object(_rank_state(parts))
    state = {
        **_meta(parts, epoch, iteration),
        **rank_states[0],
        "model_state": parts.module.state_dict(),
        "optimizer_state": parts.optimizer.state_dict(),
        "world_size": len(rank_states),
    }
    if len(rank_states) > 1:
        state["rank_states"] = rank_states
    if parts.ema is not None:
        state["ema_state"] = parts.ema.state_dict()
    if parts.master is not None:
        state["master_state"] = parts.master.state_dict()
    return state


def _wrong_layout(path, sharded_file):
    how = "FSDP.ENABLED True" if sharded_file else "FSDP.ENABLED False"
    return CheckpointError(
        f"checkpoint {path} was written by a run with {how}: resume with that "
        "setting, or start a new OUT_DIR from its weights (TRAIN.WEIGHTS; "
        "tools/consolidate_checkpoint.py makes one file of a sharded checkpoint)"
    )


def _mismatch(path, e):
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return CheckpointError(f"checkpoint {path} does not fit this model/config: {first}")


def restore(parts, path):
    """Loads the checkpoint at `path` (file or sharded directory) into the
    components; returns (epoch, iteration)."""
    if sharded.is_sharded(path) != fsdp_enabled(parts.cfg):
        raise _wrong_layout(path, sharded.is_sharded(path))
    if sharded.is_sharded(path):
        try:
            meta, own = sharded.load(path, parts.model, parts.optimizer, parts.ema)
        except CheckpointError:
            raise
        except (KeyError, RuntimeError, ValueError) as e:
            raise _mismatch(path, e) from None
        state = {**meta, **(own or {})}
    else:
        state = ckpt.load_checkpoint(path)
        try:
            parts.module.load_state_dict(state["model_state"])
            parts.optimizer.load_state_dict(state["optimizer_state"])
        except (KeyError, RuntimeError, ValueError) as e:
            raise _mismatch(path, e) from None
        if parts.ema is not None and "ema_state" in state:
            parts.ema.load_state_dict(state["ema_state"])
        if parts.master is not None and "master_state" in state:
            parts.master.load_state_dict(state["master_state"])
        ranks = state.get("rank_states")
        if ranks and len(ranks) == distributed.world_size():
            state.update(ranks[distributed.rank()])
    parts.scaler.load_state_dict(state["scaler_state"])
    # RNG streams continue where they were when the world size is unchanged; at
    # another world size the ranks' streams start afresh from RNG_SEED.
    if "rng_state" in state:
        ckpt.set_rng_state(state["rng_state"])
    if parts.train_prep is not None and "batch_rng_state" in state:
        parts.train_prep.rng.bit_generator.state = state["batch_rng_state"]["numpy"]
        parts.train_prep.generator.set_state(state["batch_rng_state"]["torch"])
    return state["epoch"], state["iter"]


def save(parts, epoch, iteration):
    """Writes a checkpoint (every rank takes part); returns its path on rank 0.

    FSDP: a sharded directory that every rank writes its part of. Otherwise one file
    that rank 0 writes. A failed write stops every rank with the same error."""
    cfg = parts.cfg
    folder = ckpt.checkpoint_dir(cfg.OUT_DIR)
    error = None
    try:
        if fsdp_enabled(cfg):
            os.makedirs(folder, exist_ok=True)
            path = os.path.join(
                folder, ckpt.checkpoint_name(epoch, iteration, sharded.SUFFIX)
            )
            sharded.save(
                path,
                parts.model,
                parts.optimizer,
                parts.ema,
                _meta(parts, epoch, iteration),
                _rank_state(parts),
            )
        else:
            state = training_state(parts, epoch, iteration)
            path = None
            if distributed.is_main():
                path = ckpt.save_checkpoint(cfg.OUT_DIR, state, epoch, iteration)
    except (OSError, CheckpointException) as e:
        error = str(getattr(e, "strerror", None) or e).strip().splitlines()[0]
    if not fsdp_enabled(cfg):
        error = distributed.broadcast_object(error)  # rank 0 wrote, all ranks know
    if error:
        # No safety net means no training: stop rather than go on unprotected.
        raise UserError(
            f"cannot write a checkpoint to {folder}: {error}; the previous "
            "checkpoints are intact"
        )
    if distributed.is_main():
        logger.info("wrote checkpoint %s", path)
    return path if distributed.is_main() else None


def train_model(cfg):
    """Trains per the config; returns the last {train, test[, test_ema]} records.

    Run it on every rank of a job (`distributed.launch` starts them). One training
    per OUT_DIR at a time. SIGTERM / SIGINT stop it at the next iteration boundary
    with a checkpoint (raising `Stopped`); rerunning resumes from it."""
    prepare_out_dir(cfg)
    distributed.check_same_config(cfg)
    lock = lock_out_dir(cfg)
    try:
        with StopRequest() as stop:
            return _train(cfg, stop)
    finally:
        if lock is not None:
            lock.release()


def _train(cfg, stop):
    setup_run(cfg)
    seed_everything(cfg.RNG_SEED)
    parts = build_components(cfg)
    logger.info(
        "model: %s params; precision %s; %s; %d train and %d test batches per "
        "epoch and rank",
        f"{sum(p.numel() for p in parts.module.parameters()):,}",
        describe_precision(parts.mode, parts.half),
        _parallel_name(cfg),
        len(parts.train_loader),
        len(parts.test_loader),
    )
    start_epoch, start_iter = 0, 0
    last = ckpt.last_checkpoint(cfg.OUT_DIR) if cfg.TRAIN.AUTO_RESUME else None
    if last:
        start_epoch, start_iter = restore(parts, last)
        logger.info(
            "resumed from %s (epoch %d, iteration %d)",
            last,
            start_epoch + 1,
            start_iter,
        )
    if distributed.is_main():
        # Only now: a run that fails to start leaves the previous config.yaml as it was.
        dump_cfg(cfg)
    period = cfg.TRAIN.CHECKPOINT_ITER_PERIOD

    def epoch_checkpoint_due(epoch):
        last = epoch + 1 == cfg.OPTIM.MAX_EPOCH
        return last or (epoch + 1) % cfg.TRAIN.CHECKPOINT_PERIOD == 0

    def on_iter_end(epoch, done, iters):
        signum = stop.agreed()
        if signum:
            path = (
                save(parts, epoch, done) if done < iters else save(parts, epoch + 1, 0)
            )
            message = stop_message(signum, epoch, done, path)
            logger.info(message)
            raise Stopped(message, signum)
        if period and done % period == 0:
            if done < iters:
                save(parts, epoch, done)
            elif not epoch_checkpoint_due(epoch):
                # The epoch's last iteration, as the start of the next epoch: without
                # an epoch checkpoint after it, a crash early in the next epoch would
                # lose two periods.
                save(parts, epoch + 1, 0)

    results = {}
    if start_epoch >= cfg.OPTIM.MAX_EPOCH:
        logger.info("all %d epochs are done: evaluating the final weights", start_epoch)
        results["test"] = test_epoch(parts, parts.module, start_epoch - 1)
        if parts.ema is not None:
            results["test_ema"] = test_epoch(
                parts, parts.ema, start_epoch - 1, "test_ema_epoch"
            )
    for epoch in range(start_epoch, cfg.OPTIM.MAX_EPOCH):
        t0 = time.perf_counter()
        results["train"] = train_epoch(parts, epoch, start_iter, on_iter_end)
        start_iter = 0
        last_epoch = epoch + 1 == cfg.OPTIM.MAX_EPOCH
        if epoch_checkpoint_due(epoch):
            save(parts, epoch + 1, 0)
        if (epoch + 1) % cfg.TRAIN.EVAL_PERIOD == 0 or last_epoch:
            results["test"] = test_epoch(parts, parts.module, epoch)
            if parts.ema is not None:
                results["test_ema"] = test_epoch(
                    parts, parts.ema, epoch, "test_ema_epoch"
                )
        logger.info("epoch %d done in %.1f s", epoch + 1, time.perf_counter() - t0)
    return results


def test_model(cfg):
    """Evaluates TEST.WEIGHTS (a checkpoint file or sharded directory) on the test
    split, on every rank of the job; returns the test_epoch record."""
    setup_run(cfg)
    distributed.check_same_config(cfg)
    seed_everything(cfg.RNG_SEED)
    if not cfg.TEST.WEIGHTS:
        raise UserError("TEST.WEIGHTS is empty: name the checkpoint to evaluate")
    # Loaded before wrapping or sharding; load_state_dict copies into the model as
    # built, in its dtypes.
    parts = build_components(
        cfg, loaders=("test",), weights=cfg.TEST.WEIGHTS, use_ema=cfg.TEST.USE_EMA
    )
    return test_epoch(parts, parts.module, cfg.OPTIM.MAX_EPOCH - 1)


def _parallel_name(cfg):
    world = distributed.world_size()
    if fsdp_enabled(cfg):
        return f"FSDP over {world} process(es)"
    return f"DDP over {world} processes" if world > 1 else "one process"
