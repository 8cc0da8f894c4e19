"""Memory figures of a stats record: the accelerator's allocator and the host process.

    memory_stats(device)
    # {mem_mb, mem_reserved_mb, alloc_retries, oom_count, host_rss_mb}

On CUDA: peak bytes allocated and reserved by torch's caching allocator since the
start (or the last reset), the allocator's retries (a cudaMalloc that failed and
was retried after freeing cached blocks: a sign of fragmentation close to the
limit) and its out-of-memory count. On a CPU the allocator figures are 0 and
`mem_mb` is the host's resident set, as before. The same keys always, so that the
CSV's columns and the dashboards' series do not change with the device.
"""

import psutil
import torch

_MB = 2**20


def host_rss_mb() -> float:
    """This process's resident set size, in MB."""
    return psutil.Process().memory_info().rss / _MB


def memory_stats(device: torch.device) -> dict[str, float | int]:
    """The memory fields of a stats record for `device` (reads the allocator's
    counters: no device synchronization)."""
    rss = host_rss_mb()
    if device.type != "cuda":
        return {
            "mem_mb": rss,
            "mem_reserved_mb": 0.0,
            "alloc_retries": 0,
            "oom_count": 0,
            "host_rss_mb": rss,
        }
    stats = torch.cuda.memory_stats(device)
    return {
        "mem_mb": stats.get("allocated_bytes.all.peak", 0) / _MB,
        "mem_reserved_mb": stats.get("reserved_bytes.all.peak", 0) / _MB,
        "alloc_retries": int(stats.get("num_alloc_retries", 0)),
        "oom_count": int(stats.get("num_ooms", 0)),
        "host_rss_mb": rss,
    }
