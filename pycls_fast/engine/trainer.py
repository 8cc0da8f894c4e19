"""The training loop: config -> components -> epochs -> logs, checkpoints, metrics.

    train_model(cfg)   # trains, evaluates every TRAIN.EVAL_PERIOD epochs; returns stats
    test_model(cfg)    # evaluates TEST.WEIGHTS; returns stats

The loops are here (`train_epoch`, `test_epoch`, the epochs of `train_model`); the
step is engine/step.py, the run's lifecycle (OUT_DIR, lock, remote mirror, start-up,
resume) engine/lifecycle.py, and what a run is built from engine/model_setup.py
(`build_components`). Every stats record goes to the log as a pycls `json_stats`
line. Under torch.distributed every rank runs the same loop on its shard of the
data; metrics are reduced across ranks and rank 0 writes the logs.

The names that lived here before the split are importable from here still.
"""

import logging
import sys
import time

import torch
import torch.nn.functional as F

from pycls_fast.components.ema import ema_alpha, update_ema
from pycls_fast.components.meters import EpochMeter, memory_mb, topk_errors
from pycls_fast.components.optimizer import lr_at, set_lr
from pycls_fast.components.precise_bn import update_precise_bn
from pycls_fast.components.precision import AmpMode
from pycls_fast.config import train_stage
from pycls_fast.engine.lifecycle import (
    checkpoint_epoch_label,
    describe_run,
    lock_out_dir,
    open_run,
    prepare_out_dir,
    prepare_test,
    prepare_train,
    pull_on_each_node,
    resolve_channel_order,
    resume,
    seed_everything,
    setup_run,
)
from pycls_fast.engine.model_setup import Components, build_components
from pycls_fast.engine.run_metrics import RunMetrics
from pycls_fast.engine.step import (
    check_finite,
    eval_forward,
    forward_backward,
    mean_logits,
    pad_sharded_forwards,
    planned_forwards,
    spike_skipped,
    step_without_images,
    train_step,
)
from pycls_fast.errors import NonFiniteLossError
from pycls_fast.observe.logging import format_eta, log_json_stats
from pycls_fast.observe.profiling import StepProfiler
from pycls_fast.runtime import distributed

# Importable from here as before the split (tests, tools, benchmarks, forks).
__all__ = [
    "Components",
    "NonFiniteLossError",
    "build_components",
    "check_finite",
    "checkpoint_epoch_label",
    "eval_forward",
    "forward_backward",
    "lock_out_dir",
    "mean_logits",
    "pad_sharded_forwards",
    "planned_forwards",
    "prepare_out_dir",
    "prepare_test",
    "pull_on_each_node",
    "resolve_channel_order",
    "seed_everything",
    "setup_run",
    "test_epoch",
    "test_model",
    "train_epoch",
    "train_model",
    "train_step",
]

logger = logging.getLogger(__name__)


def train_model(cfg):
    """Trains per the config; returns the last {train, test[, test_ema]} records.

    Run it on every rank of a job (`distributed.launch` starts them). One training
    per OUT_DIR at a time. SIGTERM / SIGINT stop it at the next iteration boundary
    with a checkpoint (raising `Stopped`); rerunning resumes from it."""
    with open_run(cfg) as (cfg, stop, remote):
        cfg = prepare_train(cfg, remote)
        parts = build_components(cfg)
        describe_run(cfg, parts)
        parts.metrics = RunMetrics(
            cfg, parts, len(parts.train_loader), distributed.is_main()
        )
        manager, start_epoch, start_iter = resume(parts, remote)
        profiler = StepProfiler(cfg, distributed.rank(), parts.device)
        # The stop signal is agreed on (a collective and a host read) every
        # TRAIN.PREEMPT_CHECK_PERIOD steps and at the end of each epoch; in one
        # process it costs nothing and is checked after every step.
        one = distributed.world_size() == 1
        check_period = 1 if one else cfg.TRAIN.PREEMPT_CHECK_PERIOD

        def on_iter_end(epoch, done, iters):
            profiler.step()
            due = done % check_period == 0 or done == iters
            manager.after_iteration(epoch, done, iters, stop.agreed() if due else 0)

        results = {}
        try:
            if start_epoch >= cfg.OPTIM.MAX_EPOCH:
                logger.info(
                    "all %d epochs are done: evaluating the final weights", start_epoch
                )
                results["test"] = test_epoch(parts, parts.model, start_epoch - 1)
                if parts.ema is not None:
                    results["test_ema"] = test_epoch(
                        parts, parts.ema, start_epoch - 1, "test_ema_epoch"
                    )
            for epoch in range(start_epoch, cfg.OPTIM.MAX_EPOCH):
                _log_stage(cfg, epoch, first=epoch == start_epoch)
                start = start_iter if epoch == start_epoch else 0
                _train_and_evaluate(parts, manager, epoch, start, on_iter_end, results)
                if remote is not None and distributed.is_main():
                    remote.push()
        except BaseException:
            manager.close(failed=True)  # no exit before the last write is complete
            raise
        else:
            manager.close()
        finally:
            profiler.close()
            parts.metrics.finish()
        return results


def _train_and_evaluate(parts, manager, epoch, start_iter, on_iter_end, results):
    """One epoch of `train_model` (from `start_iter`): training, precise BN, the
    epoch's checkpoint, and every TRAIN.EVAL_PERIOD epochs (and the last) the
    evaluations of the model and its EMA; the records go into `results`."""
    cfg, metrics = parts.cfg, parts.metrics
    t0 = time.perf_counter()
    with metrics.span("train"):
        results["train"] = train_epoch(parts, epoch, start_iter, on_iter_end)
    if cfg.BN.USE_PRECISE_STATS:  # before the epoch's checkpoint (pycls's order)
        update_precise_bn(parts, epoch)
    manager.after_epoch(epoch)
    if (epoch + 1) % cfg.TRAIN.EVAL_PERIOD == 0 or epoch + 1 == cfg.OPTIM.MAX_EPOCH:
        with metrics.span("eval"):
            results["test"] = test_epoch(parts, parts.model, epoch)
        manager.after_eval(epoch, results["test"]["top1_err"])
        if parts.ema is not None:
            with metrics.span("eval"):
                results["test_ema"] = test_epoch(
                    parts, parts.ema, epoch, "test_ema_epoch"
                )
    logger.info("epoch %d done in %.1f s", epoch + 1, time.perf_counter() - t0)


def train_epoch(parts, epoch, start_iter=0, on_iter_end=None):
    """Trains one epoch (from `start_iter`); returns its train_epoch stats record.

    A step reads nothing back from the device (no host sync) unless a log line, a
    checkpoint or the preemption check is due: losses and errors are summed on the
    device and read at LOG_PERIOD (docs/PERFORMANCE.md, "Host syncs")."""
    cfg, model, meter = parts.cfg, parts.trained, parts.train_meter
    batches = parts.train_batches
    batches.set_epoch(epoch, start_batch=start_iter)
    iters = start_iter + len(batches)
    model.train()
    if start_iter == 0:
        meter.reset()  # else it holds the sums restored with the checkpoint
    bar = _progress(iters - start_iter, distributed.is_main())
    if meter.skipped_at_start is None:
        meter.skipped_at_start = parts.scaler.skipped_steps
    skipped_before = meter.skipped_at_start
    # The record's lr if no iteration runs (a resume at the epoch's end, (epoch,
    # iters)): its last iteration's, as the uninterrupted run reports.
    lr = lr_at(cfg, epoch + min(start_iter, iters - 1) / max(iters, 1))
    try:
        for it, (inputs, targets) in enumerate(batches, start=start_iter):
            lr = lr_at(cfg, epoch + it / iters)
            set_lr(parts.optimizer, lr)
            if len(targets):
                loss, logits, _ = train_step(parts, inputs, targets)
                if not spike_skipped(parts, epoch, it):
                    hard = targets.argmax(dim=1) if targets.ndim == 2 else targets
                    top1, top5 = topk_errors(logits.float(), hard)
                    n = len(hard) if parts.reports_metrics else 0
                    meter.add(loss.detach(), top1, top5, n, step=it)
            else:
                step_without_images(parts)
            # pycls's cadence: after the step of iterations 0, P, 2P, ... of each
            # epoch (an epoch shorter than P still updates, warmup copies too).
            if parts.ema is not None and it % cfg.OPTIM.EMA_UPDATE_PERIOD == 0:
                # O2 without FSDP: the EMA follows the fp32 masters, not bf16 roundings.
                masters = parts.master.fp32_state(parts.model) if parts.master else None
                alpha = ema_alpha(cfg, epoch, train_stage(cfg, epoch)[1])
                update_ema(parts.model, parts.ema, alpha, masters)
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
    finally:  # also when a stop or an error leaves the loop
        if bar is not None:
            bar.close()
    check_finite(parts, meter, epoch)
    skipped = parts.scaler.skipped_steps - skipped_before
    return _log_train_epoch(parts, meter, epoch, iters, lr, skipped)


def _log_train_epoch(parts, meter, epoch, iters, lr, skipped):
    """The train_epoch record of the epoch that `meter` summed, logged."""
    stats = meter.summary()
    data = parts.train_batches.stats()
    record = {
        "_type": "train_epoch",
        "epoch": f"{epoch + 1}/{parts.cfg.OPTIM.MAX_EPOCH}",
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


def iterations_before(parts, epoch: int) -> int:
    """The training iterations of the epochs before `epoch` (0-based): their batch
    counts, which TRAIN.SIZE_SCHEDULE's stages change, counted once per stage."""
    lengths, total = parts.stage_lengths, 0
    for e in range(epoch):
        stage = train_stage(parts.cfg, e)
        if stage not in lengths:
            lengths[stage] = parts.train_loader.epoch_length(e)
        total += lengths[stage]
    return total


def _log_train_iter(parts, meter, epoch, it, iters, lr, skipped):
    cfg = parts.cfg
    elapsed = meter.elapsed()
    done = meter.iters
    per_iter = elapsed / max(done, 1)
    before = iterations_before(parts, epoch)
    remaining = iterations_before(parts, cfg.OPTIM.MAX_EPOCH) - before - it - 1
    data = parts.train_loader.stats()
    loss, top1, top5, images = distributed.all_reduce_sum(
        [*meter.sums(), float(meter.count)]
    )
    images = max(images, 1.0)
    record = {
        "_type": "train_iter",
        "epoch": f"{epoch + 1}/{cfg.OPTIM.MAX_EPOCH}",
        "iter": f"{it + 1}/{iters}",
        "global_iter": before + it + 1,  # over the epochs: the curves' x
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
    logger.info("evaluating %s", parts.loaded.summary(cfg.OPTIM.MAX_EPOCH))
    return test_epoch(parts, parts.model, 0, label=label)


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
