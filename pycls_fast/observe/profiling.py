"""PROF.*: a torch.profiler trace of a few training steps, and a CUDA memory snapshot.

    profiler = StepProfiler(cfg, rank, device)
    for step in training: ...; profiler.step()    # after each optimizer step
    profiler.close()                               # a run that ends early

After PROF.START steps of this process (warm-up: compilation, allocator growth,
autotuning), the next PROF.STEPS steps are profiled; then, in OUT_DIR/profile/:
- `trace_rank<r>.json`: the Chrome trace (chrome://tracing or https://ui.perfetto.dev);
- `ops_rank<r>.txt`: `key_averages()` as a table sorted by self time (device time on a
  GPU, CPU time otherwise);
- `memory_rank<r>.pickle` (CUDA, PROF.MEMORY): the allocator's history over those
  steps, for https://pytorch.org/memory_viz.
"""

import logging
import os

import torch

logger = logging.getLogger(__name__)

PROFILE_DIR = "profile"
_MEMORY_ENTRIES = 100_000  # bounded: each entry costs a few KB in the snapshot


class StepProfiler:
    """Profiles steps PROF.START + 1 .. PROF.START + PROF.STEPS of this process."""

    def __init__(self, cfg, rank: int, device: torch.device) -> None:
        self.enabled = cfg.PROF.ENABLED
        self.start = cfg.PROF.START
        self.steps = cfg.PROF.STEPS
        self.cuda = torch.device(device).type == "cuda"
        self.memory = cfg.PROF.MEMORY and self.cuda
        self.folder = os.path.join(cfg.OUT_DIR, PROFILE_DIR)
        self.rank = rank
        self.count = 0  # steps done
        self._prof = None
        self.files = []
        if self.enabled and self.start == 0:
            self._begin()  # from the first step on

    def step(self) -> None:
        """Call after each training step: the profiler starts after step PROF.START
        and stops after step PROF.START + PROF.STEPS."""
        if not self.enabled:
            return
        self.count += 1
        if self._prof is not None and self.count == self.start + self.steps:
            self._finish()
        elif self.count == self.start and self._prof is None and not self.files:
            self._begin()

    def close(self) -> None:
        """Writes what was profiled when the run ends before the last profiled step."""
        if self._prof is not None:
            self._finish()

    def _begin(self):
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        if self.memory:
            torch.cuda.memory._record_memory_history(max_entries=_MEMORY_ENTRIES)
        self._prof = torch.profiler.profile(
            activities=activities, record_shapes=True, profile_memory=True
        )
        self._prof.start()

    def _finish(self):
        prof, self._prof = self._prof, None
        if self.cuda:
            torch.cuda.synchronize()  # the steps' kernels belong in the trace
        prof.stop()
        os.makedirs(self.folder, exist_ok=True)
        first, last = self.start + 1, self.count
        trace = os.path.join(self.folder, f"trace_rank{self.rank}.json")
        prof.export_chrome_trace(trace)
        table = os.path.join(self.folder, f"ops_rank{self.rank}.txt")
        sort = "self_cuda_time_total" if self.cuda else "self_cpu_time_total"
        with open(table, "w") as f:
            f.write(f"steps {first}..{last} of rank {self.rank}, sorted by {sort}\n")
            f.write(prof.key_averages().table(sort_by=sort, row_limit=50))
        self.files = [trace, table]
        if self.memory:
            snapshot = os.path.join(self.folder, f"memory_rank{self.rank}.pickle")
            torch.cuda.memory._dump_snapshot(snapshot)
            torch.cuda.memory._record_memory_history(enabled=None)
            self.files.append(snapshot)
        logger.info("profile of steps %d..%d: %s", first, last, ", ".join(self.files))
