"""Launching a job: one process, torchrun's workers, or NUM_GPUS processes spawned
here (pycls's `NUM_GPUS N`); joining the process group and ending the process.

    result = launch(fn, cfg)   # fn(cfg) on every rank; its result on rank 0

Above runtime/distributed.py (pure helpers) and runtime/preemption.py (signals): the
launcher forwards SIGTERM to spawned ranks and reports a stopped job.
"""

import datetime
import json
import logging
import os
import random
import re
import shutil
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from yacs.config import CfgNode

from pycls_fast.config import check_launch, with_overrides
from pycls_fast.errors import (
    ConfigError,
    PyclsFastError,
    RankFailedError,
    Stopped,
    error_line,
    exit_code,
)
from pycls_fast.observe.logging import FILE_ONLY
from pycls_fast.runtime import preemption
from pycls_fast.runtime.device_info import check_gpus_usable
from pycls_fast.runtime.distributed import (
    barrier,
    destroy_process_group,
    device,
    is_main,
    local_world_size,
)


def under_torchrun() -> bool:
    """Whether this process was started by torchrun (or another env:// launcher)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def backend_for(cfg: CfgNode) -> str:
    """NCCL on GPUs (DIST_BACKEND), gloo on CPUs."""
    return cfg.DIST_BACKEND if torch.cuda.is_available() else "gloo"


def _timeout(cfg):
    return datetime.timedelta(seconds=cfg.DIST.TIMEOUT_S)


# Whether this process joined an env:// group (see exit_process).
_joined_env_group = False


def cpu_threads() -> int:
    """Threads for this rank's CPU ops: its share of the CPUs it may use, so that
    the node's ranks do not oversubscribe them.

    Under SLURM the CPUs are its task's (SLURM_CPUS_PER_TASK: a cluster without CPU
    binding does not enforce them), shared by the ranks the task runs: one when
    every rank is a task (LAUNCH.MODE slurm), LOCAL_WORLD_SIZE when one task per
    node runs torchrun. Elsewhere the cores this process may run on, shared by the
    node's LOCAL_WORLD_SIZE ranks."""
    ranks = max(local_world_size(), 1)
    cpus = os.environ.get("SLURM_CPUS_PER_TASK", "")
    tasks = _slurm_tasks_on_node()
    if cpus.isdigit() and int(cpus) > 0 and tasks:
        return max(1, int(cpus) // max(1, ranks // tasks))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    return max(1, cores // ranks)


def _slurm_tasks_on_node() -> int | None:
    """The number of tasks of this SLURM step on this node (SLURM_STEP_TASKS_PER_NODE,
    e.g. "2(x3),1", indexed by SLURM_NODEID); None outside SLURM."""
    spec = os.environ.get("SLURM_STEP_TASKS_PER_NODE") or os.environ.get(
        "SLURM_TASKS_PER_NODE", ""
    )
    counts: list[int] = []
    for part in filter(None, spec.split(",")):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part)
        if match is None:
            return None
        counts += [int(match[1])] * int(match[2] or 1)
    node = int(os.environ.get("SLURM_NODEID", "0") or 0)
    return counts[node] if node < len(counts) else None


def init_process_group(cfg: CfgNode) -> None:
    """Joins the env:// process group (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)
    with a timeout on every collective, so a lost rank stops the job instead of
    hanging it; sets this process's GPU (LOCAL_RANK, checked) and CPU threads."""
    if not torch.cuda.is_available():
        torch.set_num_threads(cpu_threads())
    dist.init_process_group(
        backend_for(cfg), timeout=_timeout(cfg), **_bind_device(cfg)
    )
    global _joined_env_group
    _joined_env_group = True


def _bind_device(cfg):
    """Sets this process's GPU and returns init_process_group's `device_id` for it
    (NCCL then forms its communicator at once, so a bad GPU fails here); {} on CPUs.
    A LOCAL_RANK beyond the visible GPUs is a DeviceError."""
    if not torch.cuda.is_available():
        return {}
    gpu = device()
    torch.cuda.set_device(gpu)
    return {"device_id": gpu} if backend_for(cfg) == "nccl" else {}


def init_single_process_group(cfg: CfgNode) -> None:
    """A process group of one (FSDP needs one even on a single device), on GPU
    LOCAL_RANK when CUDA is usable."""
    store = dist.HashStore()
    dist.init_process_group(
        backend_for(cfg),
        store=store,
        rank=0,
        world_size=1,
        timeout=_timeout(cfg),
        **_bind_device(cfg),
    )


def _match_world_size(cfg, world):
    """Under torchrun (or SLURM) the world size is the launcher's: it wins over the
    config's NUM_GPUS (one log line when they differ; tools load the config at this
    size already: launch/cli.py). Returns the config with NUM_GPUS set to it, checked
    again (batch splits, PP x DP x TP) at this size."""
    if world == cfg.NUM_GPUS:
        return cfg
    if cfg.NUM_GPUS != 1 and _rank_0_of_launcher():
        logging.getLogger(__name__).warning(
            "warning: NUM_GPUS %d of the config is replaced by the launcher's world "
            "size, %d processes",
            cfg.NUM_GPUS,
            world,
        )
    return with_overrides(cfg, {"NUM_GPUS": world})


def _rank_0_of_launcher() -> bool:
    """Whether this process is rank 0 of the launcher's (before any group exists)."""
    return os.environ.get("RANK", "0") == "0"


def _free_port(cfg):
    """cfg.PORT, or a free port from PORT_RANGE (pycls picks one at random)."""
    if cfg.PORT:
        return cfg.PORT
    lo, hi = cfg.PORT_RANGE
    # Drawn from the OS, not the `random` module: that one is seeded with RNG_SEED,
    # so two jobs of one seed on a node (a sweep's, or parallel tests) would draw the
    # same ports and collide.
    draw = random.SystemRandom()
    for _ in range(100):
        port = draw.randint(lo, hi)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("", port))
                return port
            except OSError:
                continue
    raise ConfigError(f"no free port in PORT_RANGE {list(cfg.PORT_RANGE)}")


def launch(fn: Callable[[CfgNode], Any], cfg: CfgNode) -> Any:
    """Runs `fn(cfg)` as the job the config and environment ask for; returns its result
    on rank 0 (also when this process spawned the ranks), None on the other ranks.

    - under torchrun: joins the process group of WORLD_SIZE processes;
    - NUM_GPUS > 1 outside torchrun: spawns NUM_GPUS local processes (one per GPU, or
      sharing the CPU cores) and waits; when one dies, the others are stopped and
      RankFailedError names it;
    - otherwise: runs `fn(cfg)` here (with a one-process group when FSDP is enabled).

    (LAUNCH.MODE slurm / submitit_local jobs come here on each of their tasks, as
    under torchrun: launch/submit.py.) Launch keys that cannot be honoured are refused
    first (ConfigError), and GPUs asked for (NUM_GPUS > 1 with 'nccl') on a machine
    whose driver torch cannot use are a DeviceError, before any work starts.
    """
    check_launch(cfg)
    check_gpus_usable(cfg)
    if under_torchrun():
        cfg = _match_world_size(cfg, int(os.environ["WORLD_SIZE"]))
        return _run_in_group(fn, cfg, init_process_group)
    if cfg.NUM_GPUS > 1:
        return _spawn(fn, cfg)
    if cfg.FSDP.ENABLED:
        return _run_in_group(fn, cfg, init_single_process_group)
    return fn(cfg)


def _run_in_group(fn, cfg, init):
    """fn(cfg) inside a process group; its result on rank 0, None on the others."""
    init(cfg)
    # Every rank waits for the others before leaving the group: a rank that leaves
    # first may take the store with it (a spawned run's TCPStore lives in rank 0's
    # process), and a rank still setting up a group of its own (new_group waits for
    # no one outside the group) then fails with a broken pipe after the work is done.
    # A Stopped run stopped every rank at the same iteration, so it waits too.
    try:
        try:
            out = fn(cfg)
        except Stopped:
            barrier()
            raise
        barrier()
        return out if is_main() else None
    finally:
        destroy_process_group()


def killed_message(rank: int, signal_name: str | None) -> str:
    """The line for a rank killed by a signal; SIGKILL, which no program sends
    itself, is most likely the kernel's out-of-memory killer."""
    line = f"rank {rank} was killed by {signal_name or 'a signal'}"
    if signal_name == "SIGKILL":
        line += (
            " (most likely out of memory: the kernel kills the largest process; "
            "fewer NUM_GPUS, a smaller TRAIN.BATCH_SIZE or DATA_LOADER.NUM_WORKERS)"
        )
    return line + "; the other ranks were stopped"


def warn_cpu_oversubscription(ranks: int, gpus: bool) -> None:
    """Warns (stderr, once) when more CPU ranks are spawned than this machine has
    cores: each rank then shares a core, and all of them hold a model copy."""
    cores = (
        len(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else (os.cpu_count() or 1)
    )
    if not gpus and ranks > cores:
        print(
            f"warning: NUM_GPUS {ranks} starts {ranks} CPU processes on {cores} "
            "core(s): they share the cores (slower than fewer) and each holds a copy "
            "of the model and its optimizer state",
            file=sys.stderr,
            flush=True,
        )


def _spawn(fn, cfg):
    import torch.multiprocessing as mp

    n = cfg.NUM_GPUS
    if torch.cuda.is_available() and torch.cuda.device_count() < n:
        raise ConfigError(
            f"NUM_GPUS is {n} but this machine has {torch.cuda.device_count()} GPUs"
        )
    warn_cpu_oversubscription(n, torch.cuda.is_available())
    env = {
        "MASTER_ADDR": cfg.HOST,
        "MASTER_PORT": str(_free_port(cfg)),
        "WORLD_SIZE": str(n),
        "LOCAL_WORLD_SIZE": str(n),
    }
    result = mp.get_context("spawn").SimpleQueue()
    reports = tempfile.mkdtemp(prefix="pycls_fast_ranks_")
    context = mp.start_processes(
        _spawned_worker,
        args=(fn, cfg, env, result, reports),
        nprocs=n,
        start_method="spawn",
        join=False,
    )
    # A SIGTERM sent to this launcher reaches the ranks, which checkpoint and stop.
    previous = preemption.forward_signals(lambda: [p.pid for p in context.processes])
    spawn_log = logging.getLogger("torch.multiprocessing.spawn")
    spawn_log.addFilter(_quiet_termination)
    try:
        while not context.join():
            pass
    except mp.ProcessExitedException as e:
        raise _rank_failure(e, reports) from None
    finally:
        spawn_log.removeFilter(_quiet_termination)
        preemption.restore_signals(previous)
        shutil.rmtree(reports, ignore_errors=True)
    if result.empty():
        return None
    outcome = result.get()
    if outcome[0] == "stopped":
        raise Stopped(*outcome[1:])
    return outcome[1]


def _quiet_termination(record: logging.LogRecord) -> bool:
    """Drops torch's "Terminating process N via signal SIGTERM" warning: stopping
    the other ranks after one failed is the launcher's to do, and not news."""
    return not str(record.msg).startswith("Terminating process")


def _rank_failure(e, reports: str) -> RankFailedError:
    """The error a spawned job ends with, in one line. A rank killed by a signal
    (the OOM killer) writes no report: it is named, as the cause of the others'
    errors. Else the report of the rank that failed first (the others failed on
    the same mistake, or on its consequences: a collective with a rank gone), the
    traceback of an unexpected error (a bug) printed above the line."""
    if e.exit_code is not None and e.exit_code < 0:
        return RankFailedError(killed_message(e.error_index, e.signal_name), 1)
    report = _first_report(reports)
    if report is None:
        return RankFailedError(
            f"rank {e.error_index} failed (exit status {e.exit_code}); "
            "the other ranks were stopped",
            e.exit_code if e.exit_code in (1, 2) else 1,
        )
    if report["traceback"]:
        print(report["traceback"].rstrip(), file=sys.stderr, flush=True)
    return RankFailedError(f"rank {report['rank']}: {report['line']}", report["code"])


def _first_report(reports: str) -> dict | None:
    """The earliest failure report that a rank wrote into `reports`, or None."""
    found = []
    for name in os.listdir(reports):
        if name.endswith(".json"):
            try:
                with open(os.path.join(reports, name)) as f:
                    found.append(json.load(f))
            except (OSError, ValueError):
                continue
    return min(found, key=lambda r: (r["time"], r["rank"])) if found else None


def _report_failure(reports: str, index: int, error: BaseException) -> None:
    """Writes this rank's failure for the launcher, which prints the first one
    (every rank failing on the same mistake would print it once each): its line,
    its exit status and, for an unexpected error (not pycls_fast's own: a bug), its
    traceback, which also goes to the rank's log file (OUT_DIR/stdout.log on rank
    0) where logging is set up."""
    when = time.time()
    line = error_line(error).removeprefix("error: ")
    unexpected = not isinstance(error, PyclsFastError)
    if unexpected and logging.getLogger().handlers:
        logging.getLogger(__name__).error(
            "rank %d: %s", index, line, exc_info=True, extra={FILE_ONLY: True}
        )
    code = exit_code(error)
    report = {
        "time": when,
        "rank": index,
        "line": line,
        "code": code if code in (1, 2) else 1,
        "traceback": traceback.format_exc() if unexpected else "",
    }
    path = os.path.join(reports, f"rank_{index}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(report, f)
    os.replace(path + ".tmp", path)  # whole or absent: the rank may be stopped


def _spawned_worker(index, fn, cfg, env, result, reports):
    """Entry point of a spawned rank: its env:// variables, the group, `fn(cfg)`.
    Errors end the process with pycls_fast's exit statuses (2: user mistake),
    reported to the launcher through the folder `reports` (it prints the first)."""
    os.environ.update(env, RANK=str(index), LOCAL_RANK=str(index))
    code = 0
    try:
        out = ("done", _run_in_group(fn, cfg, init_process_group))
    except Stopped as e:
        # Every rank stopped at the same iteration after the checkpoint: a clean end
        # that the launcher reports with the signal's exit status.
        out = ("stopped", str(e), e.signum)
    except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001 - mapped by type
        out, code = None, exit_code(e)
        if not isinstance(e, KeyboardInterrupt):
            try:
                _report_failure(reports, index, e)
            except OSError:  # no report folder: the line goes to stderr here
                line = error_line(e).removeprefix("error: ")
                print(f"error: rank {index}: {line}", file=sys.stderr)
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


def exit_process(code: int) -> NoReturn:
    """Exits with status `code`: through `_hard_exit` in a torchrun worker that joined
    a process group (the same teardown abort showed there too: "terminate called
    without an active exception", SIGABRT after the run had finished), else through
    SystemExit."""
    if _joined_env_group and under_torchrun():
        _hard_exit(code)
    sys.exit(code)
