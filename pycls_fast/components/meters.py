"""Meters: top-k errors, loss and speed over an epoch, reduced across processes."""

import time

import psutil
import torch

from pycls_fast.runtime import distributed


def topk_errors(logits, labels, ks=(1, 5)):
    """Top-k error rates in percent, as 0-d float64 tensors on the logits' device
    (nothing is read back to the host); logits (N, C) any float, labels (N,) int64."""
    k_max = min(max(ks), logits.size(1))
    top = logits.topk(k_max, dim=1).indices  # (N, k_max)
    correct = top.eq(labels.view(-1, 1))
    return [
        100.0 * (1.0 - correct[:, : min(k, k_max)].any(1).double().mean()) for k in ks
    ]


def memory_mb(device):
    """Peak accelerator memory (CUDA) or the process's resident memory (CPU), in MB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return psutil.Process().memory_info().rss / 2**20


class EpochMeter:
    """Sums over one epoch of one process; `summary()` reduces across processes.

    add(loss, top1_err, top5_err, n, step): per-batch means (0-d tensors or floats)
    weighted by the batch size n. The sums stay on the device of the tensors added,
    so that adding reads nothing back to the host; `sums()`, `first_non_finite()`,
    `summary()` and `state_dict()` read them (one transfer each).
    """

    def __init__(self):
        self.reset()

    def reset(self):
        self.start = time.perf_counter()
        # (3,) float64: sums of loss, top-1 and top-5 errors times batch sizes.
        self._sums = torch.zeros(3, dtype=torch.float64)
        # (2,) float64: the step of the first non-finite loss added (-1: none) and it.
        self._bad = torch.tensor([-1.0, 0.0], dtype=torch.float64)
        self.count = 0
        self.iters = 0
        # The loss scaler's total of skipped steps when the epoch began (None: not
        # known), so that the epoch's own count survives a resume mid-epoch.
        self.skipped_at_start = None

    def add(self, loss, top1_err, top5_err, n, step=None):
        values = [torch.as_tensor(v) for v in (loss, top1_err, top5_err)]
        device = values[0].device
        if self._sums.device != device:
            self._sums, self._bad = self._sums.to(device), self._bad.to(device)
        batch = torch.stack([v.to(device, torch.float64) for v in values])
        self._sums.add_(batch, alpha=n)
        first = (self._bad[0] < 0) & ~torch.isfinite(batch[0])
        where = float(self.iters if step is None else step)
        # torch.full: a fill on the device; a tensor from a host value would copy.
        at = torch.full((), where, dtype=torch.float64, device=device)
        found = torch.stack([at, batch[0]])
        self._bad.copy_(torch.where(first, found, self._bad))
        self.count += n
        self.iters += 1

    def sums(self) -> list[float]:
        """[loss_sum, top1_sum, top5_sum] of this process (reads the device)."""
        return self._sums.tolist()

    def first_non_finite(self) -> tuple[int, float] | None:
        """(step, loss) of the first non-finite loss added, or None (reads the
        device)."""
        step, loss = self._bad.tolist()
        return None if step < 0 else (int(step), loss)

    def elapsed(self):
        return time.perf_counter() - self.start

    def state_dict(self) -> dict:
        """The sums so far, as plain numbers (a checkpoint mid-epoch keeps them, so
        that the resumed epoch reports the whole epoch's loss and errors)."""
        loss, top1, top5 = self.sums()
        return {
            "loss_sum": loss,
            "top1_sum": top1,
            "top5_sum": top5,
            "count": self.count,
            "iters": self.iters,
            "elapsed": self.elapsed(),
            "skipped_at_start": self.skipped_at_start,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continues from `state_dict()`'s sums; the clock goes on from its time."""
        keys = ("loss_sum", "top1_sum", "top5_sum")
        sums = torch.tensor([float(state[k]) for k in keys], dtype=torch.float64)
        self._sums = sums.to(self._sums.device)
        self.count = int(state["count"])
        self.iters = int(state["iters"])
        self.start = time.perf_counter() - float(state["elapsed"])
        self.skipped_at_start = state.get("skipped_at_start")  # older: None

    def summary(self):
        """{loss, top1_err, top5_err, images, img_per_s}, over all processes."""
        sums = distributed.all_reduce_sum([*self.sums(), float(self.count)])
        loss, top1, top5, count = sums
        count = max(count, 1.0)
        elapsed = self.elapsed()
        return {
            "loss": loss / count,
            "top1_err": top1 / count,
            "top5_err": top5 / count,
            "images": int(count),
            "img_per_s": count / elapsed if elapsed > 0 else 0.0,
        }
