"""The run's lifecycle around the loops: its output folder, lock, remote mirror,
start-up and resume; the same for an evaluation.

    with open_run(cfg) as (cfg, stop, remote):   # OUT_DIR ready and locked
        cfg = prepare_train(cfg, remote)           # logging, weights, layout, seeds
        parts = build_components(cfg)
        manager, epoch, iteration = resume(parts, remote)

A remote (URL) OUT_DIR is trained in a local mirror, pulled once per node before
the run; checkpoints go up as they are written and the logs at each epoch's end
and when the run ends, stops or fails.
"""

import logging
import os
import random
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch
from yacs.config import CfgNode

from pycls_fast.checkpoint import CheckpointManager, files
from pycls_fast.checkpoint.remote import RemoteOut, mirror_dir, pull_on_each_node
from pycls_fast.checkpoint.run_record import record_config
from pycls_fast.checkpoint.weights import (
    TEST_WEIGHTS_EMPTY,
    checkpoint_channel_order,
    resolve_start_weights,
    resolve_weights_key,
)
from pycls_fast.components.optimizer import schedule_warnings
from pycls_fast.components.precision import apply_backend_flags, describe_precision
from pycls_fast.config import with_overrides
from pycls_fast.engine.step import check_finite
from pycls_fast.errors import OutDirInUseError, UserError
from pycls_fast.observe.logging import setup_logging
from pycls_fast.observe.stats_sinks import attach_stats_sinks
from pycls_fast.parallel.data_parallel import fsdp_enabled, sharded_checkpoints
from pycls_fast.parallel.mesh import Layout
from pycls_fast.parallel.planner import auto_layout, device_gib
from pycls_fast.runtime import distributed
from pycls_fast.runtime.device_info import describe_device, outdated_warning
from pycls_fast.runtime.preemption import StopRequest
from pycls_fast.runtime.run_lock import RunLock
from pycls_fast.storage import is_remote

logger = logging.getLogger(__name__)


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


@contextmanager
def open_run(cfg: CfgNode) -> Iterator[tuple[CfgNode, StopRequest, RemoteOut | None]]:
    """OUT_DIR made ready for one training: a remote one mirrored locally (then the
    yielded config's OUT_DIR is the mirror), checked writable and locked; yields
    (cfg, the stop request of SIGTERM / SIGINT, the remote or None). On leaving:
    the lock is released and a remote OUT_DIR gets the logs of a run that ends,
    stops or fails."""
    remote = None
    if is_remote(cfg.OUT_DIR):
        # Training works in a local mirror; checkpoints and logs go up from there.
        local = mirror_dir(cfg.OUT_DIR, cfg.OUT_MIRROR)
        remote = RemoteOut(cfg.OUT_DIR, local, cfg.TRAIN.CHECKPOINT_KEEP)
        # The same config on every rank, the URL compared (mirrors may differ by
        # node: each node's own temporary folder).
        distributed.check_same_config(cfg)
        pull_on_each_node(remote, cfg.DIST.PULL_TIMEOUT_S)
        cfg = with_overrides(cfg, {"OUT_DIR": local})
    else:
        distributed.check_same_config(cfg)
    prepare_out_dir(cfg)
    lock = lock_out_dir(cfg)
    try:
        with StopRequest() as stop:
            yield cfg, stop, remote
    finally:
        if lock is not None:
            lock.release()
        if remote is not None and distributed.is_main():
            remote.push()  # the logs of a run that ends, stops or fails


def prepare_train(cfg: CfgNode, remote: RemoteOut | None = None) -> CfgNode:
    """Sets up a training run in its (locked) OUT_DIR: logging, backend flags, the
    start weights (a run folder: its newest checkpoint), the channel order, the
    PARALLEL.AUTO layout, the seeds; returns the config so resolved."""
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
    return cfg


def describe_run(cfg: CfgNode, parts) -> None:
    """Logs what the run is: the model's size, precision, parallelism, batches,
    epochs and learning rate, and the schedule's warnings."""
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
    if distributed.is_main():  # once per job, not once per rank
        for warning in schedule_warnings(cfg):
            logger.warning("warning: %s", warning)


def resume(
    parts, remote: RemoteOut | None = None
) -> tuple[CheckpointManager, int, int]:
    """The run's checkpoint manager (each checkpoint uploaded to a remote OUT_DIR;
    none of weights a non-finite loss has touched), and where training resumes:
    returns (manager, epoch, iteration), (0, 0) for a new run. Then writes the
    config to OUT_DIR/config.yaml (only now: a run that fails to start leaves the
    previous one as it was; one that changes it keeps the old one in
    config_history/)."""
    cfg, metrics = parts.cfg, parts.metrics

    def before_save(epoch, iteration):
        # No checkpoint of weights that a non-finite loss has already touched; the
        # position (E, 0) is the end of epoch E - 1.
        check_finite(parts, parts.train_meter, epoch if iteration else epoch - 1)
        metrics.mark(epoch, iteration)

    after_save = None
    if remote is not None:

        def after_save(path):
            upload_checkpoint(cfg, remote, path)

    manager = CheckpointManager(
        parts,
        before_save=before_save,
        after_save=after_save,
        stall_timer=lambda: metrics.span("checkpoint"),
        remote=remote,
    )
    parts.before_update = manager.wait_staged
    start_epoch, start_iter = manager.restore()
    metrics.resumed_at(start_epoch, start_iter)
    if distributed.is_main():
        record_config(cfg)
    return manager, start_epoch, start_iter


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


def upload_checkpoint(cfg, remote, path):
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


def prepare_test(cfg):
    """Sets up an evaluation run (output folder, logging, seeds) and finds the
    checkpoint TEST.WEIGHTS names; returns (cfg with the channel order resolved,
    checkpoint path)."""
    setup_run(cfg)
    distributed.check_same_config(cfg)
    seed_everything(cfg.RNG_SEED)
    if not cfg.TEST.WEIGHTS:
        raise UserError(TEST_WEIGHTS_EMPTY)
    path, how = resolve_weights_key(cfg, "TEST.WEIGHTS")
    if how != "given":
        logger.info("TEST.WEIGHTS %s: %s", cfg.TEST.WEIGHTS, how)
    return resolve_channel_order(cfg, path), path


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
