#!/usr/bin/env python3
"""Launches a sweep: python tools/sweep_launch.py --sweep-cfg FILE [--retry-failed]
[--max-parallel N]

Runs each fork that is not done as `python tools/train_net.py --cfg FORK`, N at a time
(LAUNCH.PARALLEL_JOBS, or --max-parallel), each in its own OUT_DIR under
ROOT_DIR/NAME/logs/. Local runs at once get disjoint GPUs (CUDA_VISIBLE_DEVICES,
NUM_GPUS of them each), so the GPUs also bound how many run at once. With the
sweep's LAUNCH.MODE slurm (or submitit_local) each of those submits its run as a
job (train_net's LAUNCH.MODE, with the sweep's LAUNCH resources) and waits for it.
Finished runs are skipped, stopped ones resume, failed ones are rerun only with
--retry-failed. Exit status 1 when a run failed."""

import os
import sys

from pycls_fast.config import load_cfg
from pycls_fast.errors import PyclsFastError
from pycls_fast.launch.cli import ArgumentParser, run
from pycls_fast.sweep.config import load_sweep_cfg
from pycls_fast.sweep.launcher import (
    Job,
    LocalBackend,
    job_overrides,
    launch_sweep,
    visible_gpus,
)
from pycls_fast.sweep.setup import load_forks

TRAIN_NET = os.path.join(os.path.dirname(os.path.abspath(__file__)), "train_net.py")


def train_command(job: Job, launch=None) -> list[str]:
    """The command that trains one fork (the normal training path), as a job of the
    sweep's LAUNCH.MODE when `launch` (the sweep's LAUNCH section) says so."""
    extra = job_overrides(launch, job) if launch is not None else []
    return [sys.executable, TRAIN_NET, "--cfg", job.cfg_file, *extra]


def main():
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep-cfg", required=True, help="sweep config file")
    parser.add_argument(
        "--retry-failed", action="store_true", help="rerun the runs that failed"
    )
    parser.add_argument(
        "--max-parallel", type=int, help="runs at once (default LAUNCH.PARALLEL_JOBS)"
    )
    args = parser.parse_args()
    if args.max_parallel is not None and args.max_parallel < 1:
        parser.error("--max-parallel must be >= 1")
    sweep = load_sweep_cfg(args.sweep_cfg)
    runs = load_forks(sweep)["runs"]
    parallel = args.max_parallel or sweep.LAUNCH.PARALLEL_JOBS
    launch = sweep.LAUNCH
    devices, per_run = [], 1
    if launch.MODE == "local":
        # Concurrent local runs each get GPUs of their own (none on a CPU machine).
        devices = visible_gpus()
        per_run = max((load_cfg(r["cfg_file"]).NUM_GPUS for r in runs), default=1)
    backend = LocalBackend(
        lambda job: train_command(job, launch),
        parallel,
        devices=devices,
        gpus_per_run=per_run,
    )
    try:
        counts = launch_sweep(runs, backend, args.retry_failed, print)
    except KeyboardInterrupt:
        backend.stop()  # the runs checkpoint on SIGTERM; launching again resumes them
        raise
    summary = ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
    print(f"sweep: {summary}", flush=True)
    if counts.get("failed"):
        raise PyclsFastError(
            f"{counts['failed']} run(s) failed: tools/sweep_collect.py shows why; "
            "--retry-failed reruns them"
        )


if __name__ == "__main__":
    run(main)
