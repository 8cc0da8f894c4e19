"""Side-by-side timing for benchmarks on a machine shared with other jobs.

`interleave` times several variants in rounds (A, B, C, A, B, C, ...), the only
comparison that holds when other jobs come and go; `per_round_ratios` pairs the runs of
one round. CPU-time readers tell how much of a timed interval other jobs took, so that a
contended run can be repeated. Imports nothing heavy (torch only when a CUDA device is
synchronized), so that the loader benchmark can use it without shifting its memory
baseline.
"""

import os
import time
from collections.abc import Callable, Sequence


def machine_busy_seconds() -> float:
    """Seconds of non-idle CPU time of the whole machine since boot (/proc/stat; NaN
    where it cannot be read)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:9]]
    except OSError:
        return float("nan")
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def process_cpu_seconds() -> float:
    """User + system CPU time of this process (all threads) and its reaped children."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def descendants_cpu_seconds() -> dict[int, float]:
    """{pid: user + system CPU seconds} of this process's live descendants (children
    that os.times does not count until they are reaped: DataLoader workers during an
    epoch, the loader subprocesses of DATA_LOADER.MODE subprocess)."""
    tick = os.sysconf("SC_CLK_TCK")
    found, pending = {}, [os.getpid()]
    while pending:
        pid = pending.pop()
        # Each thread's own children: a loader that forks from a background
        # thread (a DataLoader iterated off the main thread) has them there.
        kids = []
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    kids += [int(k) for k in f.read().split()]
            except OSError:
                continue
        for kid in kids:
            try:
                with open(f"/proc/{kid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            found[kid] = (int(fields[11]) + int(fields[12])) / tick
            pending.append(kid)
    return found


def _sync(device) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def timed_call(fn: Callable[[], object], device) -> tuple[float, float]:
    """(seconds, other jobs' CPU in cores) of one call of `fn` on torch `device`."""
    busy0, own0 = machine_busy_seconds(), process_cpu_seconds()
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    seconds = time.perf_counter() - start
    others = machine_busy_seconds() - busy0 - (process_cpu_seconds() - own0)
    return seconds, max(others, 0.0) / seconds


def interleave(
    steps: dict[str, Callable[[], object]],
    device,
    rounds: int,
    iters: int,
    warmup: int = 1,
    max_others: float = 0.2,
    retries: int = 3,
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Times each of `steps` ({name: fn}) side by side: `warmup` untimed calls of each,
    then `rounds` rounds in which every step runs `iters` timed calls in turn.

    A call during which other jobs on the machine took more than `max_others` cores
    (/proc/stat minus this process) is repeated, up to `retries` times, keeping the
    least contended. Returns ({name: [seconds per call]}, {name: [other jobs' cores
    during each kept call]}).
    """
    for fn in steps.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in steps}
    others = {name: [] for name in steps}
    for _ in range(rounds):
        for name, fn in steps.items():
            for _ in range(iters):
                best = timed_call(fn, device)
                for _ in range(retries):
                    if not best[1] > max_others:  # NaN (no /proc/stat): keep
                        break
                    best = min(best, timed_call(fn, device), key=lambda c: c[1])
                times[name].append(best[0])
                others[name].append(best[1])
    return times, others


def per_round_ratios(
    numerators: Sequence[float], denominators: Sequence[float], scale: float = 1.0
) -> list[float]:
    """numerator / (scale x denominator) of each round. Runs of one round are seconds
    apart, those of different rounds minutes apart: the median of these ratios moves
    less with the machine's drift than a ratio of medians."""
    return [n / (scale * d) for n, d in zip(numerators, denominators, strict=True)]
