"""The memory fields: the same keys on every device, real figures on a CPU."""

import psutil
import torch

from pycls_fast.observe.memory import memory_stats


def test_cpu_memory_fields():
    stats = memory_stats(torch.device("cpu"))
    assert set(stats) == {"mem_mb", "mem_reserved_mb", "alloc_retries",
                          "oom_count", "host_rss_mb"}  # fmt: skip
    rss = psutil.Process().memory_info().rss / 2**20
    # Read a moment apart: equal within what this process allocates meanwhile.
    assert abs(stats["host_rss_mb"] - rss) < 64
    assert stats["mem_mb"] == stats["host_rss_mb"] and stats["oom_count"] == 0
