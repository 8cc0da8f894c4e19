"""CPU time of this process and of the whole machine, to tell how much of a timed
interval other jobs took. Imports nothing heavy, so that the loader benchmark can use
it without shifting its memory baseline."""

import os


def machine_busy_seconds():
    """Seconds of non-idle CPU time of the whole machine since boot (/proc/stat; NaN
    where it cannot be read)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:9]]
    except OSError:
        return float("nan")
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def process_cpu_seconds():
    """User + system CPU time of this process (all threads) and its reaped children."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system
