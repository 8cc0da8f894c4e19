"""What a sweep's run has left on disk, and its status from that alone:

    done        its log holds the final test_epoch record (epoch N/N)
    failed      it ended (exit_status.json) without that record, not by a signal
                (a signal: exit status -N from Popen, or 128 + N from a shell)
    running     a training holds its OUT_DIR's lock (this launcher's or another's)
    incomplete  it started (OUT_DIR exists) but none of these: stopped or killed
    missing     it never started

Any backend (local processes now, a SLURM array later) reads and writes the same
files, so a sweep can be launched, collected and relaunched from anywhere.
"""

import fcntl
import json
import os
import re
import time
from collections.abc import Mapping
from typing import Any

from pycls_fast.observe.logging import LOG_FILE, load_json_stats
from pycls_fast.runtime.run_lock import LOCK_FILE

EXIT_FILE = "exit_status.json"  # {"exit_code", "seconds"}: written when a run ends
LAUNCH_LOG = "launch.log"  # the run's process output (errors before logging starts)
STATUSES = ("done", "failed", "running", "incomplete", "missing")
_STOP_SIGNAL = 128  # exit statuses above: stopped by a signal, resumable


def stopped_by_signal(exit_code: int) -> bool:
    """Whether an exit status means a signal stopped the process: Popen's -N, or a
    shell's (or SLURM's) 128 + N."""
    return exit_code < 0 or exit_code > _STOP_SIGNAL


def write_json(path: str, data: Any) -> None:
    """Writes `data` as JSON at `path` atomically (a reader never sees half a file)."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def read_json(path: str) -> Any:
    """The JSON at `path`, or None when the file is missing or cut short."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return None


def records(run: Mapping[str, Any]) -> list[dict]:
    """The run's json_stats records ([] before it logs anything)."""
    log = os.path.join(run["out_dir"], LOG_FILE)
    return load_json_stats(log) if os.path.isfile(log) else []


def is_final(record: Mapping[str, Any]) -> bool:
    """Whether a test_epoch record is the last epoch's ('60/60')."""
    if record.get("_type") != "test_epoch":
        return False
    done, _, total = str(record.get("epoch", "")).partition("/")
    return bool(total) and done == total


def exit_status(run: Mapping[str, Any]) -> dict | None:
    """The run's exit_status.json ({"exit_code", "seconds"}), None before it ends."""
    return read_json(os.path.join(run["out_dir"], EXIT_FILE))


def is_running(out_dir: str) -> bool:
    """Whether a training holds OUT_DIR's lock now (runtime/run_lock.py's flock, which
    the kernel drops when the training ends, however it ends)."""
    try:
        fd = os.open(os.path.join(out_dir, LOCK_FILE), os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # also releases the shared lock taken just now
    return False


def run_status(run: Mapping[str, Any], stats: list[dict] | None = None) -> str:
    """One of STATUSES for a run of cfgs.json (`stats`: its records, if read)."""
    stats = records(run) if stats is None else stats
    if any(is_final(r) for r in stats):
        return "done"
    ended = exit_status(run)
    if is_running(run["out_dir"]):
        return "running"
    if ended is not None and not stopped_by_signal(ended.get("exit_code", 1)):
        return "failed"
    return "incomplete" if os.path.isdir(run["out_dir"]) else "missing"


def launch_header(command: Any) -> str:
    """The line a launcher writes to launch.log before each attempt's output."""
    return f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} {command}\n"


_HEADER = re.compile(r"--- \d{4}-\d\d-\d\d \d\d:\d\d:\d\d ")


def failure_line(run: Mapping[str, Any]) -> str:
    """Why a failed run ended: the last error line its last attempt printed (the
    lines of launch.log after the last launch header), else that attempt's last line,
    else its exit status ('' with neither a log nor an exit status)."""
    path = os.path.join(run["out_dir"], LAUNCH_LOG)
    lines = []
    if os.path.isfile(path):
        with open(path, errors="replace") as f:
            for line in f:
                if _HEADER.match(line):
                    lines = []  # an earlier attempt's output: not this ending's cause
                elif line.strip():
                    lines.append(line.strip())
    errors = [line for line in lines if line.startswith("error")]
    if errors or lines:
        return (errors or lines)[-1][:300]
    ended = exit_status(run)
    if ended is None:
        return ""
    return f"no output from the last attempt (exit status {ended.get('exit_code')})"
