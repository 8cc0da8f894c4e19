"""CheckpointManager: when to save, what, and how, for one training run.

    manager = CheckpointManager(parts)         # parts: the run's components
    epoch, it = manager.restore()              # TRAIN.AUTO_RESUME: newest checkpoint
    manager.after_iteration(epoch, done, iters, signum)  # iteration period, stop
    manager.after_epoch(epoch)                 # epoch period, last epoch
    manager.after_eval(epoch, top1_err)        # best pointer, retention
    manager.close()                            # the last asynchronous write is done

What: the model, EMA, optimizer, master weights, loss scaler, and each rank's RNG
states (global and the device batches') and epoch meter sums, each a Stateful.
How: one file that rank 0 writes (its `rank_states` hold every rank's own states
under DDP), or under FSDP a sharded directory that every rank writes its part of
(sharded.py). With TRAIN.CHECKPOINT_ASYNC the write runs beside training
(async_writer.py): a save waits for the previous one, stages the state to host
memory and returns; retention and the upload of a remote OUT_DIR follow the write
once it is complete (files: rank 0's part seen after any step; sharded: at the next
save, the end of an epoch or `close()`). Every rank keeps the write in flight, rank
0's thread or the others' empty one, until the next save, the end of an epoch with a
sharded one, a keep-best evaluation, a stop or `close()` completes it on all ranks
together: so every rank runs the same collectives there.

Where: every rank resumes from the same checkpoint, the newest that every rank's
OUT_DIR holds complete (a node-local mirror may lack one that rank 0's holds); a
node-local folder (a remote OUT_DIR's mirror on another node than rank 0's) keeps
the checkpoints rank 0's keeps, and its leftovers of interrupted writes are cleared
at the start, as rank 0's are.
"""

import logging
import os
from contextlib import nullcontext

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

# Submodules by their full names: `from pycls_fast.checkpoint import ...` would
# run the package's __init__, which imports this module.
import pycls_fast.checkpoint.files as files
import pycls_fast.checkpoint.remote as remote_out
import pycls_fast.checkpoint.retention as retention
import pycls_fast.checkpoint.run_record as run_record
import pycls_fast.checkpoint.sharded as sharded
from pycls_fast.checkpoint.async_writer import FileWrite, HostStager, ShardedWrite
from pycls_fast.checkpoint.cadence import (
    epoch_checkpoint_due,
    iteration_checkpoint,
    stop_checkpoint,
)
from pycls_fast.checkpoint.state import GlobalRng
from pycls_fast.checkpoint.weights import describe_misfits
from pycls_fast.errors import CheckpointError, Stopped, UserError
from pycls_fast.observe.logging import FILE_ONLY
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
    # Loading an optimizer's state also brings back its groups' settings (weight
    # decay, betas, momentum, lr scales): the config's, as built, are put back
    # after it, so that a change accepted with TRAIN.ACCEPT_CHANGES takes effect.
    settings = [
        {k: v for k, v in group.items() if k != "params"}
        for group in parts.optimizer.param_groups
    ]
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
    for group, own in zip(parts.optimizer.param_groups, settings, strict=True):
        group.update(own)
    parts.scaler.load_state_dict(state["scaler_state"])
    guard = getattr(parts, "spike_guard", None)
    if guard is not None and "spike_state" in state:
        guard.load_state_dict(state["spike_state"])
    # A rank's own parts (RNG streams, epoch sums) continue where they were when
    # the world size is unchanged; at another world size the ranks' streams start
    # afresh from RNG_SEED (a file's top-level states are rank 0's: loaded on every
    # rank they would give all ranks the same draws) and the sums from zero.
    if state.get("world_size") == distributed.world_size():
        for key, part in _rank_parts(parts).items():
            if key in state:
                part.load_state_dict(state[key])
    return state["epoch"], state["iter"]


def _write_error(folder, error):
    # No safety net means no training: stop rather than go on unprotected.
    return UserError(
        f"cannot write a checkpoint to {folder}: {error}; the previous "
        "checkpoints are intact"
    )


def _first_line(e: BaseException) -> str:
    return str(getattr(e, "strerror", None) or e).strip().splitlines()[0]


def _sharded_path(cfg, epoch: int, iteration: int) -> str:
    """The sharded checkpoint folder of (epoch, iteration), its parent made."""
    folder = files.checkpoint_dir(cfg.OUT_DIR)
    os.makedirs(folder, exist_ok=True)
    return os.path.join(folder, files.checkpoint_name(epoch, iteration, sharded.SUFFIX))


def start_save(parts, epoch: int, iteration: int, stager, group):
    """Starts writing the checkpoint of (epoch, iteration) beside training (every
    rank takes part): the state is staged to host memory by `stager` (files) or by
    DCP (sharded, its collectives on `group`) before this returns; returns the
    write (async_writer)."""
    cfg = parts.cfg
    if sharded_checkpoints(cfg):
        path = _sharded_path(cfg, epoch, iteration)
        future = sharded.start_save(
            path,
            parts.trained,
            parts.optimizer,
            parts.ema,
            _meta(parts, epoch, iteration),
            _rank_state(parts),
            process_group=group,
        )
        return ShardedWrite(path, future, sharded.publish)
    state = training_state(parts, epoch, iteration)
    if not distributed.is_main():
        return FileWrite(None)
    out_dir = cfg.OUT_DIR

    def write(staged):
        return files.save_checkpoint(out_dir, staged, epoch, iteration)

    if parts.device.type == "cpu":
        # The copy runs beside the next forward and backward (wait_staged).
        return FileWrite(write, state, stager.stage)
    return FileWrite(write, stager.stage(state))


def finish_write(cfg, write) -> str | None:
    """Every rank: waits for an asynchronous write to complete; returns its path on
    rank 0; UserError on every rank when it failed."""
    folder = files.checkpoint_dir(cfg.OUT_DIR)
    error, path = None, None
    try:
        path = write.wait()
    except (OSError, CheckpointException) as e:
        error = _first_line(e)
    if not sharded_checkpoints(cfg):
        error = distributed.broadcast_object(error)
    if error:
        raise _write_error(folder, error)
    if distributed.is_main() and not getattr(write, "completed", False):
        logger.info("wrote checkpoint %s (asynchronously)", path)
    return path if distributed.is_main() else None


def save(parts, epoch: int, iteration: int):
    """Writes a checkpoint (every rank takes part); returns its path on rank 0.

    FSDP: a sharded directory that every rank writes its part of. Otherwise one file
    that rank 0 writes. A failed write stops every rank with the same error."""
    cfg = parts.cfg
    folder = files.checkpoint_dir(cfg.OUT_DIR)
    error, path = None, None
    try:
        if sharded_checkpoints(cfg):
            path = _sharded_path(cfg, epoch, iteration)
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
        error = _first_line(e)
    if not sharded_checkpoints(cfg):
        error = distributed.broadcast_object(error)  # rank 0 wrote, all ranks know
    if error:
        raise _write_error(folder, error)
    if distributed.is_main():
        logger.info("wrote checkpoint %s", path)
    return path if distributed.is_main() else None


class CheckpointManager:
    """Saves and restores the checkpoints of one run (every rank makes one)."""

    def __init__(
        self,
        parts,
        before_save=None,
        after_save=None,
        stall_timer=None,
        remote=None,
    ):
        """`before_save(epoch, iteration)`: called before the checkpoint of that
        position is written (it may raise to prevent it); `after_save(path)`: on
        every rank once it is written and retention applied (`path` None on ranks
        other than 0); `stall_timer()`: a context manager around the time a save
        keeps the caller (goodput's checkpoint stalls); `remote`: the RemoteOut of
        a remote OUT_DIR (OUT_DIR is then its mirror), which a resume fetches the
        checkpoint files this rank reads from. Every rank makes one, at the same
        point (a collective: whether this rank's OUT_DIR is rank 0's)."""
        self.parts = parts
        self.remote = remote
        self.before_save = before_save
        self.after_save = after_save
        self.stall_timer = stall_timer or nullcontext
        self.asynchronous = parts.cfg.TRAIN.CHECKPOINT_ASYNC
        self.pending = None  # the asynchronous write in flight
        self._stager = None
        self._group = None
        self.cfg = parts.cfg
        self.out_dir = parts.cfg.OUT_DIR
        train = parts.cfg.TRAIN
        self.keep_last = train.CHECKPOINT_KEEP
        self.keep_best = train.CHECKPOINT_KEEP_BEST
        self.best = None
        if self.keep_best and distributed.is_main():
            self.best = retention.read_best(self.out_dir)
        # The first rank of a node whose OUT_DIR is not rank 0's (a node-local
        # mirror) keeps that folder as rank 0 keeps its own.
        self.own_folder = (
            not remote_out.sees_main_folder(self.out_dir)
            and distributed.local_rank() == 0
        )
        if self.own_folder:
            files.remove_partial(self.out_dir)

    def restore(self):
        """With TRAIN.AUTO_RESUME, loads the newest checkpoint that every rank's
        OUT_DIR holds complete (every rank the same); returns the (epoch,
        iteration) to start from ((0, 0) without one). Of a remote OUT_DIR's
        sharded checkpoint, the files this rank reads are fetched first."""
        if not self.cfg.TRAIN.AUTO_RESUME:
            return 0, 0
        name = agreed_checkpoint(self.out_dir)
        if name is None:
            return 0, 0
        last = os.path.join(files.checkpoint_dir(self.out_dir), name)
        if self.remote is not None and files.is_sharded(last):
            p = self.parts
            needed = sharded.files_to_read(last, p.trained, p.optimizer, p.ema)
            remote_out.fetch_checkpoint(
                self.remote, name, needed, self.cfg.DIST.PULL_TIMEOUT_S
            )
        epoch, iteration = restore(self.parts, last)
        logger.info(
            "resumed from %s (epoch %d, iteration %d)", last, epoch + 1, iteration
        )
        return epoch, iteration

    def save(self, epoch: int, iteration: int, wait: bool = False):
        """Writes the checkpoint of (epoch, iteration) and applies retention;
        returns its path on rank 0. With TRAIN.CHECKPOINT_ASYNC (and not `wait`)
        it returns once the state is staged (None): the write goes on beside
        training, and a previous write in flight is completed first."""
        if self.before_save is not None:
            self.before_save(epoch, iteration)
        with self.stall_timer():
            self.finish_pending()
            if self.asynchronous and not wait:
                self.pending = start_save(
                    self.parts, epoch, iteration, self._host_stager(), self._pg()
                )
                return None
            path = save(self.parts, epoch, iteration)
        self._completed(path)
        self._keep_node_folders()
        return path

    def _host_stager(self):
        if self._stager is None:
            self._stager = HostStager(pin=self.parts.device.type == "cuda")
        return self._stager

    def _pg(self):
        """A gloo group of its own for DCP's background collectives (sharing the
        training's group from another thread could interleave collectives
        differently on different ranks)."""
        if (
            self._group is None
            and sharded_checkpoints(self.cfg)
            and dist.is_initialized()
        ):
            self._group = dist.new_group(backend="gloo")
        return self._group

    def wait_staged(self) -> None:
        """Before the optimizer changes the weights: waits until a write in flight
        has copied them (a checkpoint stall when it had not)."""
        write = self.pending
        if isinstance(write, FileWrite) and not write.staged():
            with self.stall_timer():
                write.wait_staged()

    def poll(self) -> None:
        """Rank 0 of a single-file write that has finished: its own part of
        completing it (retention, upload) at once; no collective, so any rank may
        call it at any step. The write stays in flight on every rank until
        `finish_pending` (every rank's collective: a rank that dropped it there
        alone would meet the others' broadcast with another collective). A failed
        write waits for `finish_pending` to stop every rank together."""
        write = self.pending
        if not isinstance(write, FileWrite) or write.completed or not write.done():
            return
        if write.error is None and write.path is not None:
            write.completed = True
            logger.info("wrote checkpoint %s (asynchronously)", write.path)
            self._completed(write.path)

    def finish_pending(self) -> None:
        """Every rank: waits for the asynchronous write in flight, if any, and
        completes it (retention, the after_save hook)."""
        write, self.pending = self.pending, None
        if write is None:
            return
        path = finish_write(self.cfg, write)
        if not getattr(write, "completed", False):
            self._completed(path)
        self._keep_node_folders()

    def close(self, failed: bool = False) -> None:
        """The run ends: its last write completes before the process may exit.
        `failed`: ending on an error, maybe on this rank alone: a sharded write is
        only waited for (no collective, so it stays incomplete)."""
        write = self.pending
        if write is None:
            return
        if failed:
            self.pending = None
            try:
                write.wait_local() if isinstance(write, ShardedWrite) else write.wait()
            except Exception as e:  # noqa: BLE001 - already failing: say it, go on
                logger.warning("checkpoint write failed: %s", _first_line(e))
            return
        self.finish_pending()

    def _completed(self, path):
        """This rank's part of completing the checkpoint at `path` (None on ranks
        other than 0): the best pointer, retention, the after_save hook."""
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
            path = self.save(*stop_checkpoint(epoch, done, iters), wait=True)
            message = stop_message(signum, epoch, done, path)
            # The log file keeps it; the console gets it once, as the tool's last
            # line (the Stopped error), not also here.
            logger.info(message, extra={FILE_ONLY: True})
            raise Stopped(message, signum)
        self.poll()
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
        """After `epoch` is trained: saves on the epoch period and the last epoch;
        a sharded asynchronous write in flight is completed first."""
        if isinstance(self.pending, ShardedWrite):
            with self.stall_timer():
                self.finish_pending()
        if epoch_checkpoint_due(
            epoch, self.cfg.OPTIM.MAX_EPOCH, self.cfg.TRAIN.CHECKPOINT_PERIOD
        ):
            self.save(epoch + 1, 0)

    def after_eval(self, epoch: int, top1_err: float):
        """After the model trained for `epoch` is evaluated: with
        TRAIN.CHECKPOINT_KEEP_BEST, a checkpoint of these weights with the lowest
        test error so far becomes the best (best.json); retention follows."""
        if self.keep_best and self.pending is not None:
            with self.stall_timer():
                self.finish_pending()  # these weights' checkpoint may be in flight
        if not self.keep_best:
            return
        if distributed.is_main():
            self._mark_best(epoch, top1_err)
        self._keep_node_folders()

    def _mark_best(self, epoch, top1_err):
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

    def _keep_node_folders(self):
        """Every rank, after rank 0's retention: a node-local folder drops the
        checkpoints rank 0's no longer holds (its own copies, which rank 0 does
        not see, and pulled ones)."""
        if not self.keep_last or distributed.world_size() == 1:
            return
        kept = None
        if distributed.is_main():
            kept = [os.path.basename(p) for p in files.list_checkpoints(self.out_dir)]
        kept = distributed.broadcast_object(kept)
        if self.own_folder:
            retention.keep_only(self.out_dir, kept)


def agreed_checkpoint(out_dir: str) -> str | None:
    """Every rank: the name of the newest checkpoint that every rank's `out_dir`
    holds complete, or None. Node-local folders may differ: a mirror that lacks
    rank 0's newest (written there, its upload cut short by a stop) must not make
    the ranks load different epochs into one model."""
    names = [os.path.basename(p) for p in files.list_checkpoints(out_dir)]
    everyone = distributed.all_gather_object(names)
    common = [n for n in everyone[0] if all(n in other for other in everyone)]
    chosen = common[-1] if common else None
    newest = everyone[0][-1] if everyone[0] else None
    if newest is not None and newest != chosen and distributed.is_main():
        lacking = [r for r, other in enumerate(everyone) if newest not in other]
        logger.warning(
            "warning: %s, the newest checkpoint in rank 0's OUT_DIR, is not complete "
            "in the OUT_DIR of rank(s) %s: every rank resumes from %s",
            newest,
            ", ".join(map(str, lacking[:8])),
            chosen or "the start",
        )
    return chosen
