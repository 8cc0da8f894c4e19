"""Meters: top-k errors, loss and speed over an epoch, reduced across processes."""

import time

import psutil
import torch

from pycls_fast.core import distributed


def topk_errors(logits, labels, ks=(1, 5)):
    """Top-k error rates in percent; logits (N, C) any float, labels (N,) int64."""
    k_max = min(max(ks), logits.size(1))
    top = logits.topk(k_max, dim=1).indices  # (N, k_max)
    correct = top.eq(labels.view(-1, 1))
    return [
        100.0 * (1.0 - correct[:, : min(k, k_max)].any(1).float().mean().item())
        for k in ks
    ]


def memory_mb(device):
    """Peak accelerator memory (CUDA) or the process's resident memory (CPU), in MB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return psutil.Process().memory_info().rss / 2**20


class EpochMeter:
    """Sums over one epoch of one process; `summary()` reduces across processes.

    add(loss, top1_err, top5_err, n): per-batch means weighted by the batch size n.
    """

    def __init__(self):
        self.reset()

    def reset(self):
        self.start = time.perf_counter()
        self.loss_sum = 0.0
        self.top1_sum = 0.0
        self.top5_sum = 0.0
        self.count = 0
        self.iters = 0

    def add(self, loss, top1_err, top5_err, n):
        self.loss_sum += loss * n
        self.top1_sum += top1_err * n
        self.top5_sum += top5_err * n
        self.count += n
        self.iters += 1

    def elapsed(self):
        return time.perf_counter() - self.start

    def state_dict(self) -> dict:
        """The sums so far, as plain numbers (a checkpoint mid-epoch keeps them, so
        that the resumed epoch reports the whole epoch's loss and errors)."""
        return {
            "loss_sum": self.loss_sum,
            "top1_sum": self.top1_sum,
            "top5_sum": self.top5_sum,
            "count": self.count,
            "iters": self.iters,
            "elapsed": self.elapsed(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continues from `state_dict()`'s sums; the clock goes on from its time."""
        self.loss_sum = float(state["loss_sum"])
        self.top1_sum = float(state["top1_sum"])
        self.top5_sum = float(state["top5_sum"])
        self.count = int(state["count"])
        self.iters = int(state["iters"])
        self.start = time.perf_counter() - float(state["elapsed"])

    def summary(self):
        """{loss, top1_err, top5_err, images, img_per_s}, over all processes."""
        sums = distributed.all_reduce_sum(
            [self.loss_sum, self.top1_sum, self.top5_sum, float(self.count)]
        )
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
