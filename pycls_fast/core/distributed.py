"""Process-group helpers: rank, world size, the device of this process, reductions,
and `launch`, which runs a function in one process, under torchrun, or in NUM_GPUS
processes it spawns itself (pycls's `NUM_GPUS N`).

Work in a single process needs none of it: every helper falls back to rank 0 of 1.
"""

import datetime
import hashlib
import logging
import os
import random
import socket
import sys

import torch
import torch.distributed as dist

from pycls_fast.config import ConfigError, check_cfg


def is_initialized():
    return dist.is_available() and dist.is_initialized()


def rank():
    return dist.get_rank() if is_initialized() else 0


def world_size():
    return dist.get_world_size() if is_initialized() else 1


def is_main():
    """Whether this process writes logs, plots and single-file outputs."""
    return rank() == 0


def local_rank():
    return int(os.environ.get("LOCAL_RANK", 0))


def local_world_size():
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size()))


def device():
    """This process's device: its GPU when there is one, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank() % torch.cuda.device_count())
    return torch.device("cpu")


def local_tensor(t):
    """This rank's shard of a DTensor (FSDP parameter, gradient, state), else `t`."""
    return t.to_local() if hasattr(t, "to_local") else t


def all_reduce_sum(values):
    """Sums a list of floats across processes (identity in a single process)."""
    return _all_reduce(values, dist.ReduceOp.SUM)


def all_reduce_max(values):
    """Maximum of a list of floats across processes (identity in a single process)."""
    return _all_reduce(values, dist.ReduceOp.MAX)


def _all_reduce(values, op):
    if not is_initialized():
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=_reduce_device())
    dist.all_reduce(t, op=op)
    return t.tolist()


def _reduce_device():
    # NCCL reduces CUDA tensors only; gloo reduces CPU tensors.
    return device() if dist.get_backend() == "nccl" else torch.device("cpu")


def barrier():
    if is_initialized():
        dist.barrier()


def broadcast_object(obj):
    """Rank 0's `obj`, on every rank (identity in a single process)."""
    if not is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_gather_object(obj):
    """Every rank's `obj`, in rank order ([obj] in a single process)."""
    if not is_initialized():
        return [obj]
    out = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def check_same_config(cfg):
    """Raises ConfigError when any rank was started with another config than rank 0
    (e.g. different command-line overrides on different nodes)."""
    if not is_initialized():
        return
    digests = all_gather_object(hashlib.sha256(cfg.dump().encode()).hexdigest())
    differ = [r for r, d in enumerate(digests) if d != digests[0]]
    if differ:
        raise ConfigError(
            f"the config of rank {differ[0]} differs from rank 0's: start every "
            "process with the same --cfg file and KEY VALUE overrides"
        )


# --------------------------------------------------------------------------------- #
# Launching
# --------------------------------------------------------------------------------- #


def under_torchrun():
    """Whether this process was started by torchrun (or another env:// launcher)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def backend_for(cfg):
    """NCCL on GPUs (DIST_BACKEND), gloo on CPUs."""
    return cfg.DIST_BACKEND if torch.cuda.is_available() else "gloo"


def _timeout(cfg):
    return datetime.timedelta(seconds=cfg.DIST.TIMEOUT_S)


# Whether this process joined an env:// group (see exit_process).
_joined_env_group = False


def init_process_group(cfg):
    """Joins the env:// process group (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)
    with a timeout on every collective, so a lost rank stops the job instead of
    hanging it; sets this process's GPU and CPU threads."""
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank() % torch.cuda.device_count())
    else:
        # N processes on one CPU box share its cores: no oversubscription.
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
        torch.set_num_threads(max(1, cores // max(local_world_size(), 1)))
    dist.init_process_group(backend_for(cfg), timeout=_timeout(cfg))
    global _joined_env_group
    _joined_env_group = True


def init_single_process_group(cfg):
    """A process group of one (FSDP needs one even on a single device)."""
    store = dist.HashStore()
    dist.init_process_group(
        backend_for(cfg), store=store, rank=0, world_size=1, timeout=_timeout(cfg)
    )


def destroy_process_group():
    if is_initialized():
        dist.destroy_process_group()


def _match_world_size(cfg, world):
    """Under torchrun the world size is torchrun's: NUM_GPUS must be 1 (the default)
    or equal to it; batch sizes are then checked against it."""
    if cfg.NUM_GPUS not in (1, world):
        raise ConfigError(
            f"NUM_GPUS ({cfg.NUM_GPUS}) does not match torchrun's WORLD_SIZE "
            f"({world}): leave NUM_GPUS at 1 under torchrun, or set it to the world "
            "size"
        )
    cfg.defrost()
    cfg.NUM_GPUS = world
    check_cfg(cfg)


def _free_port(cfg):
    """cfg.PORT, or a free port from PORT_RANGE (pycls picks one at random)."""
    if cfg.PORT:
        return cfg.PORT
    lo, hi = cfg.PORT_RANGE
    for _ in range(100):
        port = random.randint(lo, hi)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("", port))
                return port
            except OSError:
                continue
    raise ConfigError(f"no free port in PORT_RANGE {list(cfg.PORT_RANGE)}")


class RankFailedError(RuntimeError):
    """A spawned process failed; `exit_code` is the status the job ends with."""

    def __init__(self, message, exit_code):
        super().__init__(message)
        self.exit_code = exit_code


def launch(fn, cfg):
    """Runs `fn(cfg)` as the job the config and environment ask for; returns its result
    on rank 0 (also when this process spawned the ranks), None on the other ranks.

    - under torchrun: joins the process group of WORLD_SIZE processes;
    - NUM_GPUS > 1 outside torchrun: spawns NUM_GPUS local processes (one per GPU, or
      sharing the CPU cores) and waits; when one dies, the others are stopped and
      RankFailedError names it;
    - otherwise: runs `fn(cfg)` here (with a one-process group when FSDP is enabled).
    """
    if under_torchrun():
        _match_world_size(cfg, int(os.environ["WORLD_SIZE"]))
        return _run_in_group(fn, cfg, init_process_group)
    if cfg.NUM_GPUS > 1:
        return _spawn(fn, cfg)
    if cfg.FSDP.ENABLED:
        return _run_in_group(fn, cfg, init_single_process_group)
    return fn(cfg)


def _run_in_group(fn, cfg, init):
    """fn(cfg) inside a process group; its result on rank 0, None on the others."""
    init(cfg)
    try:
        out = fn(cfg)
        return out if is_main() else None
    finally:
        destroy_process_group()


def _spawn(fn, cfg):
    import torch.multiprocessing as mp

    from pycls_fast.core import preemption  # it builds on this module

    n = cfg.NUM_GPUS
    if torch.cuda.is_available() and torch.cuda.device_count() < n:
        raise ConfigError(
            f"NUM_GPUS is {n} but this machine has {torch.cuda.device_count()} GPUs"
        )
    env = {
        "MASTER_ADDR": cfg.HOST,
        "MASTER_PORT": str(_free_port(cfg)),
        "WORLD_SIZE": str(n),
        "LOCAL_WORLD_SIZE": str(n),
    }
    result = mp.get_context("spawn").SimpleQueue()
    context = mp.start_processes(
        _spawned_worker,
        args=(fn, cfg, env, result),
        nprocs=n,
        start_method="spawn",
        join=False,
    )
    # A SIGTERM sent to this launcher reaches the ranks, which checkpoint and stop.
    previous = preemption.forward_signals(lambda: [p.pid for p in context.processes])
    try:
        while not context.join():
            pass
    except mp.ProcessExitedException as e:
        if e.exit_code is not None and e.exit_code > 0:
            # The rank printed its own error line; end with its status.
            raise RankFailedError(
                f"rank {e.error_index} failed (exit status {e.exit_code}); "
                "the other ranks were stopped",
                e.exit_code if e.exit_code in (1, 2) else 1,
            ) from None
        raise RankFailedError(
            f"rank {e.error_index} was killed by {e.signal_name or 'a signal'}; the "
            "other ranks were stopped",
            1,
        ) from None
    finally:
        preemption.restore_signals(previous)
    if result.empty():
        return None
    outcome = result.get()
    if outcome[0] == "stopped":
        raise preemption.Stopped(*outcome[1:])
    return outcome[1]


def _spawned_worker(index, fn, cfg, env, result):
    """Entry point of a spawned rank: its env:// variables, the group, `fn(cfg)`.
    Errors end the process with pycls_fast's exit statuses (2: user mistake)."""
    from pycls_fast.core.cli import UserError
    from pycls_fast.core.preemption import Stopped

    os.environ.update(env, RANK=str(index), LOCAL_RANK=str(index))
    code = 0
    try:
        out = ("done", _run_in_group(fn, cfg, init_process_group))
    except Stopped as e:
        # Every rank stopped at the same iteration after the checkpoint: a clean end
        # that the launcher reports with the signal's exit status.
        out = ("stopped", str(e), e.signum)
    except (ConfigError, UserError) as e:
        print(f"error: rank {index}: {e}", file=sys.stderr)
        out, code = None, 2
    except KeyboardInterrupt:
        out, code = None, 130
    except Exception as e:  # noqa: BLE001 - reported with the rank, then exit 1
        print(f"error: rank {index}: {type(e).__name__}: {e}", file=sys.stderr)
        out, code = None, 1
    if index == 0 and out is not None:
        result.put(out)
    _hard_exit(code)


def _hard_exit(code):
    """Ends a process that used a process group, skipping the interpreter's teardown:
    torch's gloo objects still alive then (device meshes cache their groups) can
    abort the process (SIGABRT) while being destroyed, after all work is done."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def exit_process(code):
    """Exits with status `code`: through `_hard_exit` in a torchrun worker that joined
    a process group (the same teardown abort showed there too: "terminate called
    without an active exception", SIGABRT after the run had finished), else through
    SystemExit."""
    if _joined_env_group and under_torchrun():
        _hard_exit(code)
    sys.exit(code)
