"""LAUNCH.MODE slurm / submitit_local: the tools' job submitted through submitit.

    job = submit(train, cfg)        # prints the job id, its logs, how to follow it
    wait(job, cfg)                  # LAUNCH.WAIT: the job's result, or its failure

On every task of the job (one per GPU, or per slot of a CPU-only partition) `ClusterJob`
wires submitit's JobEnvironment to torch.distributed's env:// variables and runs the
tool's function as one rank, exactly as under torchrun (launch/processes.py). A
stop signal (SLURM's `--signal` USR2 before the time limit, SIGTERM of a preemption or
`scontrol requeue`) goes through the trainer's preemption path: every rank agrees, a
checkpoint is written, the ranks exit; a USR2 stop requeues the job (at most
LAUNCH.MAX_RETRY times) and the requeued job resumes from OUT_DIR (TRAIN.AUTO_RESUME).
SLURM requeues a preempted job itself.
"""

import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from yacs.config import CfgNode

from pycls_fast.config import check_launch, with_overrides
from pycls_fast.errors import Stopped, UserError
from pycls_fast.launch.processes import launch
from pycls_fast.storage import is_remote

# submitit's LocalExecutor reruns a job whose task exits with this status.
LOCAL_REQUEUE_EXIT = 144


def job_shape(cfg: CfgNode) -> tuple[int, int]:
    """(nodes, tasks per node): NUM_GPUS ranks, at most MAX_GPUS_PER_NODE per node
    (one task per GPU, or per slot of a CPU-only partition)."""
    check_launch(cfg)  # a partial last node is refused
    per_node = cfg.MAX_GPUS_PER_NODE
    return math.ceil(cfg.NUM_GPUS / per_node), min(cfg.NUM_GPUS, per_node)


def job_parameters(cfg: CfgNode) -> dict[str, Any]:
    """The `update_parameters` of the job's submitit executor (pycls's LAUNCH keys):
    AutoExecutor's for slurm, LocalExecutor's for submitit_local."""
    nodes, tasks = job_shape(cfg)
    launch_cfg = cfg.LAUNCH
    params = {"timeout_min": launch_cfg.TIME_LIMIT, "nodes": nodes}
    params["tasks_per_node"] = tasks
    if not launch_cfg.CPU_ONLY:
        params["gpus_per_node"] = tasks
    if launch_cfg.MODE == "slurm":
        params["name"] = launch_cfg.NAME
        params["cpus_per_task"] = launch_cfg.CPUS_PER_GPU
        # Partition, memory and constraint: the cluster's defaults unless set.
        if launch_cfg.MEM_PER_GPU:
            params["mem_gb"] = launch_cfg.MEM_PER_GPU * tasks
        if launch_cfg.PARTITION:
            params["slurm_partition"] = launch_cfg.PARTITION
        params["slurm_signal_delay_s"] = launch_cfg.SIGNAL_DELAY_S
        if launch_cfg.COMMENT:
            params["slurm_comment"] = launch_cfg.COMMENT
        if launch_cfg.GPU_TYPE and not launch_cfg.CPU_ONLY:
            params["slurm_constraint"] = launch_cfg.GPU_TYPE
        extra = {}
        if launch_cfg.EMAIL:
            extra = {"mail-user": launch_cfg.EMAIL, "mail-type": "END,FAIL"}
        extra.update(sbatch_args(launch_cfg.SBATCH_ARGS))
        if extra:
            params["slurm_additional_parameters"] = extra
    else:
        params["signal_delay_s"] = launch_cfg.SIGNAL_DELAY_S
    return params


def sbatch_args(args) -> dict[str, Any]:
    """LAUNCH.SBATCH_ARGS as submitit's additional parameters: 'name=value' ->
    {name: value}, a bare 'name' -> {name: True} (an sbatch flag: --name)."""
    out: dict[str, Any] = {}
    for arg in args:
        name, sep, value = arg.partition("=")
        out[name.lstrip("-")] = value if sep else True
    return out


def rank_environment(
    job_id: str, global_rank: int, local_rank: int, tasks: int, nodes: int, master: str
) -> dict[str, str]:
    """torch.distributed's env:// variables of one task of a job. The port is derived
    from the job id, so that jobs sharing a node do not collide, and kept in
    10000-29999, below Linux's ephemeral ports (32768 and up): a port there can be
    taken by any outgoing connection, and the rendezvous then fails with
    EADDRINUSE."""
    return {
        "RANK": str(global_rank),
        "WORLD_SIZE": str(tasks),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(tasks // max(nodes, 1)),
        "MASTER_ADDR": master,
        "MASTER_PORT": str(
            10000 + int("".join(c for c in job_id if c.isdigit()) or 0) % 20000
        ),  # fmt: skip
    }


class ClusterJob:
    """The callable submitit runs on every task: `fn(cfg)` as one rank of the job."""

    def __init__(self, fn: Callable[[CfgNode], Any], cfg: CfgNode) -> None:
        self.fn = fn
        # The job runs its ranks itself: no second submission from the node.
        self.cfg = with_overrides(cfg, {"LAUNCH.MODE": "local"})
        self.max_retry = cfg.LAUNCH.MAX_RETRY
        self.mode = cfg.LAUNCH.MODE

    def __call__(self) -> Any:
        import submitit

        env = submitit.JobEnvironment()
        restarts = self._restarts(env)
        os.environ.update(
            rank_environment(
                str(env.job_id),
                env.global_rank,
                env.local_rank,
                env.num_tasks,
                env.num_nodes,
                env.hostnames[0] if self.mode == "slurm" else "127.0.0.1",
            )
        )
        try:
            return launch(self.fn, self.cfg)
        except Stopped as stopped:
            self._after_stop(env, stopped, restarts)

    def _marker(self, env) -> str:
        # The local executor reruns the same command: its requeues are counted here.
        return os.path.join(str(env.paths.folder), f"{env.job_id}_requeues")

    def _restarts(self, env) -> int:
        """Times this job was requeued so far (read when it starts, by every rank)."""
        if self.mode == "slurm":
            return int(os.environ.get("SLURM_RESTART_COUNT", "0"))
        if not os.path.exists(self._marker(env)):
            return 0
        with open(self._marker(env)) as f:
            return int(f.read() or 0)

    def _after_stop(self, env, stopped: Stopped, restarts: int) -> None:
        """A stopped run (checkpoint written): requeue it, or let SLURM do so. Exits
        without a result, so that submitit does not report the job as ended."""
        if self.mode == "slurm" and stopped.signum == signal.SIGTERM:
            # Preemption or `scontrol requeue`: SLURM requeues (or cancels) the job.
            raise SystemExit(stopped.exit_code)
        if restarts >= self.max_retry:
            raise UserError(
                f"stopped by {signal.Signals(stopped.signum).name} after "
                f"{restarts} requeue(s) (LAUNCH.MAX_RETRY {self.max_retry}): not "
                "requeued; the checkpoint is written, submit again to resume"
            ) from None
        if self.mode == "slurm":
            if env.global_rank == 0:
                subprocess.check_call(["scontrol", "requeue", str(env.job_id)])
            raise SystemExit(stopped.exit_code)
        if env.global_rank == 0:
            with open(self._marker(env), "w") as f:
                f.write(str(restarts + 1))
        raise SystemExit(LOCAL_REQUEUE_EXIT)


def _executor(cfg: CfgNode, need_sbatch: bool = True):
    import submitit

    if is_remote(cfg.OUT_DIR):
        raise UserError(
            f"LAUNCH.MODE {cfg.LAUNCH.MODE}: OUT_DIR {cfg.OUT_DIR} is remote, but "
            "submitit keeps its job files in OUT_DIR/submitit on a shared file "
            "system; use a shared folder as OUT_DIR, or LAUNCH.MODE local"
        )
    folder = os.path.join(cfg.OUT_DIR, "submitit")
    cluster = "slurm" if cfg.LAUNCH.MODE == "slurm" else "local"
    if cluster == "slurm" and need_sbatch and not _have("sbatch"):
        raise UserError(
            "LAUNCH.MODE slurm: no `sbatch` on this machine; submit from a SLURM "
            "login node, or use LAUNCH.MODE submitit_local / local"
        )
    if cluster == "slurm":
        executor = submitit.AutoExecutor(folder=folder, cluster=cluster)
    else:
        executor = submitit.LocalExecutor(folder=folder)
    executor.update_parameters(**job_parameters(cfg))
    return executor


def _have(program: str) -> bool:
    from shutil import which

    return which(program) is not None


def submit(fn: Callable[[CfgNode], Any], cfg: CfgNode):
    """Submits `fn(cfg)` as a job per LAUNCH.*; prints its id, logs and how to follow
    it; returns the submitit Job."""
    os.makedirs(cfg.OUT_DIR, exist_ok=True)
    job = _executor(cfg).submit(ClusterJob(fn, cfg))
    nodes, tasks = job_shape(cfg)
    where = "SLURM" if cfg.LAUNCH.MODE == "slurm" else "submitit (local)"
    print(f"submitted job {job.job_id} to {where}: {nodes} node(s) x {tasks} task(s)")
    print(f"  job log:  {job.paths.stdout} (.err: {job.paths.stderr})")
    print(f"  run log:  {os.path.join(cfg.OUT_DIR, 'stdout.log')}")
    follow = f"tail -f {os.path.join(cfg.OUT_DIR, 'stdout.log')}"
    if cfg.LAUNCH.MODE == "slurm":
        follow += f"   |   squeue -j {job.job_id}"
    print(f"  follow:   {follow}", flush=True)
    return job


def describe_job(fn: Callable[[CfgNode], Any], cfg: CfgNode) -> str:
    """What `submit(fn, cfg)` would submit, in words: the shape (nodes x tasks x
    GPUs), the command each task runs, the log paths, and the sbatch script
    (LAUNCH.MODE slurm) or the local executor's parameters. Submits nothing and
    needs no cluster."""
    nodes, tasks = job_shape(cfg)
    gpus = 0 if cfg.LAUNCH.CPU_ONLY else 1
    executor = _executor(cfg, need_sbatch=False)
    # submitit's own text for the job (private API: the script `submit` writes).
    inner = getattr(executor, "_executor", executor)
    command = inner._submitit_command_str
    folder = os.path.join(cfg.OUT_DIR, "submitit")
    lines = [
        f"dry run (LAUNCH.DRY_RUN): nothing submitted to "
        f"{'SLURM' if cfg.LAUNCH.MODE == 'slurm' else 'submitit (local)'}",
        f"  job:      {nodes} node(s) x {tasks} task(s) x {gpus} GPU(s) per task "
        f"= {cfg.NUM_GPUS} rank(s), {cfg.LAUNCH.TIME_LIMIT} min",
        f"  each task runs: {command}",
        f"    (unpickles {getattr(fn, '__name__', 'the tool')}(cfg) and runs it as one "
        "torch.distributed rank)",
        f"  job log:  {os.path.join(folder, '%j_%t_log.out')} (.err)",
        f"  run log:  {os.path.join(cfg.OUT_DIR, 'stdout.log')}",
    ]
    if cfg.LAUNCH.MODE == "slurm":
        script = inner._make_submission_file_text(command, "dry_run")
        lines += ["  sbatch script:", script.rstrip()]
    else:
        lines += [f"  submitit parameters: {job_parameters(cfg)}"]
    return "\n".join(lines)


def _in_queue(job_id: str) -> bool:
    out = subprocess.run(
        ["squeue", "-h", "-j", str(job_id), "-o", "%T"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return bool(out.stdout.strip())


def wait(job, cfg: CfgNode, poll_s: float = 2.0) -> Any:
    """Waits for `job`; returns its result, or raises a UserError naming the reason
    and the log. A job that leaves the queue without a result (cancelled, killed
    before it could write one) is reported too, never waited on forever."""
    import submitit

    gone_since = None
    while not job.paths.result_pickle.exists():
        if cfg.LAUNCH.MODE == "slurm":
            gone = not _in_queue(job.job_id)
        else:
            gone = job._process is not None and job._process.poll() is not None
        gone_since = (gone_since or time.monotonic()) if gone else None
        # The result is written just before the job leaves the queue: a grace period.
        if gone_since and time.monotonic() - gone_since > 15:
            raise UserError(
                f"job {job.job_id} ended without a result (cancelled or killed); "
                f"see {job.paths.stderr}"
            )
        time.sleep(poll_s)
    try:
        return job.results()[0]  # rank 0's
    except submitit.core.utils.FailedJobError as e:
        lines = [line for line in str(e).strip().splitlines() if line.strip()]
        reason = next(
            (line.strip() for line in reversed(lines) if "Error" in line), lines[-1]
        )
        raise UserError(
            f"job {job.job_id} failed: {reason}; see {job.paths.stderr}"
        ) from None


def submit_or_launch(fn: Callable[[CfgNode], Any], cfg: CfgNode) -> Any:
    """LAUNCH.MODE local: `launch(fn, cfg)` here. slurm / submitit_local: submits
    the job; returns None at once, or with LAUNCH.WAIT its result (rank 0's)."""
    if cfg.LAUNCH.MODE == "local":
        return launch(fn, cfg)
    if cfg.LAUNCH.DRY_RUN:
        print(describe_job(fn, cfg), flush=True)
        return None
    job = submit(fn, cfg)
    if not cfg.LAUNCH.WAIT:
        return None
    print(f"waiting for job {job.job_id} (LAUNCH.WAIT)", file=sys.stderr, flush=True)
    return wait(job, cfg)
