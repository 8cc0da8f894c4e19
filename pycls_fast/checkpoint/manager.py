"""CheckpointManager: when to save, what, and how, for one training run.

    manager = CheckpointManager(parts)         # parts: the run's components
    epoch, it = manager.restore()              # TRAIN.AUTO_RESUME: newest checkpoint
    manager.after_iteration(epoch, done, iters, signum)  # iteration period, stop
    manager.after_epoch(epoch)                 # epoch period, last epoch
    manager.after_eval(epoch, top1_err)        # best pointer, retention

What: the model, EMA, optimizer, master weights, loss scaler, and each rank's RNG
states (global and the device batches') and epoch meter sums, each a Stateful.
How: one file that rank 0 writes (its `rank_states` hold every rank's own states
under DDP), or under FSDP a sharded directory that every rank writes its part of
(sharded.py).
"""

import logging
import os

from torch.distributed.checkpoint.api import CheckpointException

# Submodules by their full names: `from pycls_fast.checkpoint import ...` would
# run the package's __init__, which imports this module.
import pycls_fast.checkpoint.files as files
import pycls_fast.checkpoint.retention as retention
import pycls_fast.checkpoint.run_record as run_record
import pycls_fast.checkpoint.sharded as sharded
from pycls_fast.checkpoint.cadence import (
    epoch_checkpoint_due,
    iteration_checkpoint,
    stop_checkpoint,
)
from pycls_fast.checkpoint.state import GlobalRng
from pycls_fast.checkpoint.weights import describe_misfits
from pycls_fast.errors import CheckpointError, Stopped, UserError
from pycls_fast.parallel.data_parallel import sharded_checkpoints
from pycls_fast.runtime import distributed
from pycls_fast.runtime.preemption import stop_message

logger = logging.getLogger(__name__)


def _meta(parts, epoch, iteration):
    """What every rank shares in a checkpoint: position, loss scale, config."""
    return {
        "epoch": epoch,
        "iter": iteration,
        "scaler_state": parts.scaler.state_dict(),
        **_spike_state(parts),
        "cfg": parts.cfg.dump(),
        "world_size": distributed.world_size(),
    }


def _spike_state(parts):
    guard = getattr(parts, "spike_guard", None)
    return {} if guard is None else {"spike_state": guard.state_dict()}


def _rank_parts(parts):
    """The Stateful parts each rank has of its own: its RNG states and its sums of
    the epoch in training (train_meter)."""
    own = {"rng_state": GlobalRng(parts.device)}
    # The prefetcher's state: that of the batches handed out, not of one queued ahead.
    batches = getattr(parts, "train_batches", None) or parts.train_prep
    if batches is not None:
        own["batch_rng_state"] = batches
    meter = getattr(parts, "train_meter", None)
    if meter is not None:
        own["train_meter"] = meter
    return own


def _rank_state(parts):
    return {key: part.state_dict() for key, part in _rank_parts(parts).items()}


def training_state(parts, epoch: int, iteration: int) -> dict:
    """The single-file checkpoint dict of a run at (epoch, iteration into it). Under
    DDP it holds every rank's RNG states (`rank_states`), gathered on all ranks."""
    rank_states = distributed.all_gather_object(_rank_state(parts))
    state = {
        **_meta(parts, epoch, iteration),
        **rank_states[0],
        "model_state": parts.model.state_dict(),
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
    return CheckpointError(
        f"checkpoint {path} is one file, written without FSDP, TP or PP: resume "
        "with FSDP.ENABLED False, PARALLEL.TP 1 and PARALLEL.PP 1, or start a new "
        "OUT_DIR from its weights (TRAIN.WEIGHTS)"
    )


def _mismatch(path, e, parts=None, state=None):
    """The one line of a checkpoint that does not load: the first tensors that
    differ (names and shapes) and the config keys that differ from the checkpoint's
    (`state`: its dict, when read), else the loader's first line."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    what = []
    if parts is not None and isinstance(state, dict):
        model_state = state.get("model_state")
        if isinstance(model_state, dict):
            what += describe_misfits(model_state, parts.model.state_dict())
        if isinstance(state.get("cfg"), str):
            keys = [
                f"{k} {a!r} -> {b!r}"
                for k, a, b in run_record.differing_keys(state["cfg"], parts.cfg)
                if not run_record.is_safe(k)
            ]
            if keys:
                what.append(
                    "config keys that differ from the checkpoint's: "
                    + ", ".join(keys[:6])
                )
    detail = "; ".join(what) if what else first
    return CheckpointError(
        f"checkpoint {path} does not fit this model/config: {detail}"
    )


def restore(parts, path: str):
    """Loads the checkpoint at `path` (file or sharded directory) into the
    components; returns (epoch, iteration)."""
    is_sharded = files.is_sharded(path)
    # A sharded (DCP) checkpoint loads at any layout, one process included; a file
    # only into a run that writes files.
    if not is_sharded and sharded_checkpoints(parts.cfg):
        raise _wrong_layout(path, is_sharded)
    if is_sharded:
        try:
            meta, own = sharded.load(path, parts.trained, parts.optimizer, parts.ema)
        except CheckpointError:
            raise
        except (KeyError, RuntimeError, ValueError) as e:
            raise _mismatch(path, e) from None
        state = {**meta, **(own or {})}
    else:
        state = files.load_checkpoint(path)
        try:
            parts.model.load_state_dict(state["model_state"])
            parts.optimizer.load_state_dict(state["optimizer_state"])
        except (KeyError, RuntimeError, ValueError) as e:
            raise _mismatch(path, e, parts, state) from None
        if parts.ema is not None and "ema_state" in state:
            parts.ema.load_state_dict(state["ema_state"])
        if parts.master is not None and "master_state" in state:
            parts.master.load_state_dict(state["master_state"])
        ranks = state.get("rank_states")
        if ranks and len(ranks) == distributed.world_size():
            state.update(ranks[distributed.rank()])
    parts.scaler.load_state_dict(state["scaler_state"])
    guard = getattr(parts, "spike_guard", None)
    if guard is not None and "spike_state" in state:
        guard.load_state_dict(state["spike_state"])
    # RNG streams continue where they were when the world size is unchanged; at
    # another world size the ranks' streams start afresh from RNG_SEED.
    same_world = state.get("world_size") == distributed.world_size()
    for key, part in _rank_parts(parts).items():
        # Epoch sums are each rank's share of the old world's: only valid unchanged.
        if key in state and (same_world or key != "train_meter"):
            part.load_state_dict(state[key])
    return state["epoch"], state["iter"]


def save(parts, epoch: int, iteration: int):
    """Writes a checkpoint (every rank takes part); returns its path on rank 0.

    FSDP: a sharded directory that every rank writes its part of. Otherwise one file
    that rank 0 writes. A failed write stops every rank with the same error."""
    cfg = parts.cfg
    folder = files.checkpoint_dir(cfg.OUT_DIR)
    error, path = None, None
    try:
        if sharded_checkpoints(cfg):
            os.makedirs(folder, exist_ok=True)
            path = os.path.join(
                folder, files.checkpoint_name(epoch, iteration, sharded.SUFFIX)
            )
            sharded.save(
                path,
                parts.trained,
                parts.optimizer,
                parts.ema,
                _meta(parts, epoch, iteration),
                _rank_state(parts),
            )
        else:
            state = training_state(parts, epoch, iteration)
            if distributed.is_main():
                path = files.save_checkpoint(cfg.OUT_DIR, state, epoch, iteration)
    except (OSError, CheckpointException) as e:
        error = str(getattr(e, "strerror", None) or e).strip().splitlines()[0]
    if not sharded_checkpoints(cfg):
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


class CheckpointManager:
    """Saves and restores the checkpoints of one run (every rank makes one)."""

    def __init__(self, parts, before_save=None, after_save=None):
        """`before_save(epoch, iteration)`: called before the checkpoint of that
        position is written (it may raise to prevent it); `after_save(path)`: on
        every rank once it is written and retention applied (`path` None on ranks
        other than 0)."""
        self.parts = parts
        self.before_save = before_save
        self.after_save = after_save
        self.cfg = parts.cfg
        self.out_dir = parts.cfg.OUT_DIR
        train = parts.cfg.TRAIN
        self.keep_last = train.CHECKPOINT_KEEP
        self.keep_best = train.CHECKPOINT_KEEP_BEST
        self.best = None
        if self.keep_best and distributed.is_main():
            self.best = retention.read_best(self.out_dir)

    def restore(self):
        """With TRAIN.AUTO_RESUME, loads the newest complete checkpoint; returns the
        (epoch, iteration) to start from ((0, 0) without one)."""
        last = (
            files.last_checkpoint(self.out_dir) if self.cfg.TRAIN.AUTO_RESUME else None
        )
        if not last:
            return 0, 0
        epoch, iteration = restore(self.parts, last)
        logger.info(
            "resumed from %s (epoch %d, iteration %d)", last, epoch + 1, iteration
        )
        return epoch, iteration

    def save(self, epoch: int, iteration: int):
        """Writes the checkpoint of (epoch, iteration) and applies retention;
        returns its path on rank 0."""
        if self.before_save is not None:
            self.before_save(epoch, iteration)
        path = save(self.parts, epoch, iteration)
        if path and self.best and os.path.basename(path) == self.best["checkpoint"]:
            # Its weights were replaced: their test error is not known yet.
            self.best = None
            retention.forget_best(self.out_dir)
        self._retain()
        if self.after_save is not None:
            self.after_save(path)
        return path

    def after_iteration(self, epoch: int, done: int, iters: int, signum: int = 0):
        """After `done` of `iters` iterations of `epoch`: saves on the iteration
        period; on an agreed stop signal `signum`, saves and raises Stopped."""
        if signum:
            path = self.save(*stop_checkpoint(epoch, done, iters))
            message = stop_message(signum, epoch, done, path)
            logger.info(message)
            raise Stopped(message, signum)
        train = self.cfg.TRAIN
        due = iteration_checkpoint(
            epoch,
            done,
            iters,
            self.cfg.OPTIM.MAX_EPOCH,
            train.CHECKPOINT_PERIOD,
            train.CHECKPOINT_ITER_PERIOD,
        )
        if due is not None:
            self.save(*due)

    def after_epoch(self, epoch: int):
        """After `epoch` is trained: saves on the epoch period and the last epoch."""
        if epoch_checkpoint_due(
            epoch, self.cfg.OPTIM.MAX_EPOCH, self.cfg.TRAIN.CHECKPOINT_PERIOD
        ):
            self.save(epoch + 1, 0)

    def after_eval(self, epoch: int, top1_err: float):
        """After the model trained for `epoch` is evaluated: with
        TRAIN.CHECKPOINT_KEEP_BEST, a checkpoint of these weights with the lowest
        test error so far becomes the best (best.json); retention follows."""
        if not (self.keep_best and distributed.is_main()):
            return
        suffix = sharded.SUFFIX if sharded_checkpoints(self.cfg) else files.SUFFIX
        name = files.checkpoint_name(epoch + 1, 0, suffix)
        if not os.path.exists(os.path.join(files.checkpoint_dir(self.out_dir), name)):
            return  # these weights were not saved
        if self.best is None or top1_err < self.best["top1_err"]:
            self.best = retention.write_best(self.out_dir, name, epoch + 1, top1_err)
            logger.info("best checkpoint: %s (top1_err %.3f)", name, top1_err)
        self._retain()

    def _retain(self):
        if self.keep_last and distributed.is_main():
            protected = {self.best["checkpoint"]} if self.best else set()
            retention.apply_retention(self.out_dir, self.keep_last, protected)
