"""Launching a sweep's runs through a backend, with a progress line per start and end.

    backend = LocalBackend(command=train_command, max_parallel=2)
    counts = launch_sweep(runs, backend, retry_failed=False)

A backend takes jobs and reports when they start and end; the driver (`launch_sweep`)
chooses which runs to submit (not done; failed ones only with `retry_failed`), prints
progress and an ETA, and never needs to know where the runs execute. SLURM runs go
through the same backend: each subprocess is `train_net.py ... LAUNCH.MODE slurm
LAUNCH.WAIT True` (`job_overrides`), which submits the run as a SLURM job through
submitit, waits for it and ends with its status (docs/SWEEPS.md).
"""

import collections
import dataclasses
import os
import subprocess
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pycls_fast.errors import UserError
from pycls_fast.observe.logging import format_eta
from pycls_fast.sweep.runs import (
    EXIT_FILE,
    LAUNCH_LOG,
    failure_line,
    launch_header,
    records,
    run_status,
    write_json,
)


@dataclasses.dataclass(frozen=True)
class Job:
    """One run to execute: its name, its fork's config file and its OUT_DIR."""

    name: str
    cfg_file: str
    out_dir: str


@dataclasses.dataclass(frozen=True)
class Event:
    """A job started (`exit_code` None) or ended (with its exit status)."""

    job: Job
    exit_code: int | None = None
    seconds: float = 0.0


class Backend(ABC):
    """Where a sweep's jobs run. `submit` hands over jobs; `wait` blocks until some
    start or end and returns those events, or [] once every submitted job ended."""

    max_parallel: int = 1

    @abstractmethod
    def submit(self, jobs: Sequence[Job]) -> None:
        """Queues `jobs` (they start when the backend has room)."""

    @abstractmethod
    def wait(self) -> list[Event]:
        """Events since the last call; [] when nothing is queued or running."""


class LocalBackend(Backend):
    """Jobs as subprocesses of this machine, `max_parallel` at a time. Each gets
    OUT_DIR/launch.log (its output) and OUT_DIR/exit_status.json when it ends, and
    OMP_NUM_THREADS = the cores / max_parallel, so parallel runs do not fight over
    the cores.

    `devices` (GPU ids, e.g. `visible_gpus()`): each job gets `gpus_per_run` of them
    of its own as CUDA_VISIBLE_DEVICES (a run of NUM_GPUS k sees its k GPUs as
    0..k-1), so runs at once are also bounded by len(devices) // gpus_per_run.
    Empty or None (a CPU machine, or jobs that only submit to SLURM): no devices
    are assigned."""

    def __init__(
        self,
        command: Callable[[Job], list[str]],
        max_parallel: int = 1,
        env: Mapping[str, str] | None = None,
        poll_s: float = 0.2,
        devices: Sequence[str] | None = None,
        gpus_per_run: int = 1,
    ):
        self.command = command
        self.max_parallel = max(1, max_parallel)
        self.blocks: list[str] = []  # free CUDA_VISIBLE_DEVICES values, one per run
        if devices:
            if gpus_per_run > len(devices):
                raise UserError(
                    f"a run of NUM_GPUS {gpus_per_run} needs more GPUs than the "
                    f"{len(devices)} visible here"
                )
            k = gpus_per_run
            self.blocks = [
                ",".join(map(str, devices[i : i + k]))
                for i in range(0, len(devices) - k + 1, k)
            ]
            self.max_parallel = min(self.max_parallel, len(self.blocks))
        self.env = dict(os.environ if env is None else env)
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
        self.env.setdefault("OMP_NUM_THREADS", str(max(1, cores // self.max_parallel)))
        self.poll_s = poll_s
        self.queue: collections.deque[Job] = collections.deque()
        self.running: dict[Job, tuple[subprocess.Popen, float, Any]] = {}
        self.devices_of: dict[Job, str] = {}

    def submit(self, jobs: Sequence[Job]) -> None:
        self.queue.extend(jobs)

    def _start(self, job: Job) -> Event:
        os.makedirs(job.out_dir, exist_ok=True)
        exit_file = os.path.join(job.out_dir, EXIT_FILE)
        if os.path.exists(exit_file):
            os.remove(exit_file)  # a rerun: its old ending no longer holds
        command = self.command(job)
        log = open(os.path.join(job.out_dir, LAUNCH_LOG), "a")  # noqa: SIM115
        log.write(launch_header(command))
        log.flush()
        env = self.env
        if self.blocks:
            self.devices_of[job] = self.blocks.pop(0)
            env = {**env, "CUDA_VISIBLE_DEVICES": self.devices_of[job]}
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        self.running[job] = (proc, time.monotonic(), log)
        return Event(job)

    def wait(self) -> list[Event]:
        events = []
        while self.queue and len(self.running) < self.max_parallel:
            events.append(self._start(self.queue.popleft()))
        if events:
            return events
        while self.running:
            for job, (proc, t0, log) in list(self.running.items()):
                code = proc.poll()
                if code is None:
                    continue
                log.close()
                seconds = time.monotonic() - t0
                write_json(
                    os.path.join(job.out_dir, EXIT_FILE),
                    {"exit_code": code, "seconds": round(seconds, 3)},
                )
                del self.running[job]
                if job in self.devices_of:
                    self.blocks.append(self.devices_of.pop(job))
                events.append(Event(job, code, seconds))
            if events:
                return events
            time.sleep(self.poll_s)
        return []

    def stop(self) -> None:
        """Terminates the running jobs (they checkpoint on SIGTERM and resume later)."""
        for proc, _, _ in self.running.values():
            proc.terminate()
        for proc, _, log in self.running.values():
            proc.wait()
            log.close()
        self.running.clear()


def visible_gpus(env: Mapping[str, str] | None = None) -> list[str]:
    """The GPU ids this process may hand out: CUDA_VISIBLE_DEVICES's entries when it
    is set, else 0..n-1 for torch's CUDA device count (none on a CPU machine)."""
    env = os.environ if env is None else env
    listed = env.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [d.strip() for d in listed.split(",") if d.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def job_overrides(launch: Mapping[str, Any], job: Job) -> list[str]:
    """The train_net overrides that run `job` as a job of the sweep's LAUNCH.MODE
    ('slurm' or 'submitit_local'; none for 'local'), waited for, with the sweep's
    LAUNCH resources and the run's name as the job name."""
    if launch["MODE"] == "local":
        return []
    keys = ["CPUS_PER_GPU", "MEM_PER_GPU", "TIME_LIMIT", "MAX_RETRY", "CPU_ONLY"]
    keys += [k for k in ("PARTITION", "GPU_TYPE", "COMMENT") if launch[k]]
    out = ["LAUNCH.MODE", launch["MODE"], "LAUNCH.WAIT", "True"]
    out += ["LAUNCH.NAME", job.name, "NUM_GPUS", str(launch["NUM_GPUS"])]
    for key in keys:
        out += [f"LAUNCH.{key}", str(launch[key])]
    return out


def _job(run: Mapping[str, Any]) -> Job:
    return Job(run["name"], run["cfg_file"], run["out_dir"])


def _final_error(run: Mapping[str, Any]) -> str:
    tests = [r for r in records(run) if r.get("_type") == "test_epoch"]
    return f", top-1 err {tests[-1]['top1_err']:.2f}%" if tests else ""


def launch_sweep(
    runs: Sequence[Mapping[str, Any]],
    backend: Backend,
    retry_failed: bool = False,
    out: Callable[[str], None] = print,
) -> dict[str, int]:
    """Runs the sweep's runs that are not done through `backend` (failed ones only
    with `retry_failed`); prints a line per start and end with counts and an ETA.
    Returns the final count of runs per status."""
    status = {run["name"]: run_status(run) for run in runs}
    by_name = {run["name"]: run for run in runs}
    todo = [
        r
        for r in runs
        if status[r["name"]] in ("missing", "incomplete")
        or (retry_failed and status[r["name"]] == "failed")
    ]
    counts = collections.Counter(status.values())
    skipped = [f"{counts['done']} done"]
    if counts["running"]:
        skipped.append(f"{counts['running']} running elsewhere")
    if counts["failed"] and not retry_failed:
        skipped.append(f"{counts['failed']} failed (--retry-failed reruns them)")
    out(
        f"sweep: {len(runs)} runs; skipping {', '.join(skipped)}; running {len(todo)}, "
        f"{backend.max_parallel} at a time"
    )
    backend.submit([_job(r) for r in todo])
    ended, durations, running = 0, [], 0
    while events := backend.wait():
        for event in events:
            name = event.job.name
            if event.exit_code is None:
                running += 1
                queued = len(todo) - ended - running
                out(f"start {name} ({running} running, {queued} queued)")
                continue
            running -= 1
            ended += 1
            durations.append(event.seconds)
            status[name] = run_status(by_name[name])
            if status[name] == "done":
                what = f"done in {event.seconds:.1f} s{_final_error(by_name[name])}"
            else:
                why = failure_line(by_name[name]) or "see " + os.path.join(
                    event.job.out_dir, LAUNCH_LOG
                )
                what = f"{status[name]} (exit status {event.exit_code}): {why}"
            left = len(todo) - ended
            eta = sum(durations) / len(durations) * left / backend.max_parallel
            tally = collections.Counter(status.values())
            out(
                f"end {name}: {what} | {ended}/{len(todo)} ended; sweep: "
                f"{tally['done']} done, {tally['failed']} failed of {len(runs)} | "
                f"ETA {format_eta(eta)}"
            )
    return dict(collections.Counter(status.values()))
