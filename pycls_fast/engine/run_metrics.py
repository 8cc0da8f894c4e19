"""The figures a training run adds to its records: TFLOP/s and MFU, the gradient norm,
memory, the loss scale, and the goodput account of its wall time.

    metrics = RunMetrics(cfg, parts, iters_per_epoch, is_main)
    metrics.resumed_at(epoch, iteration)          # after the checkpoint is restored
    with metrics.span("train"): train_epoch(...)  # also "eval"; "checkpoint" (saves)
    record |= metrics.step_fields(parts, img_per_s)         # train_iter, train_epoch
    record |= metrics.goodput_fields(epoch, it, data_wait_s)  # and saves the account
    metrics.finish()                              # the run's goodput record

Only the main process measures the peak and keeps the account; the gradient norm is
read on the host only here, at log lines (train_step leaves it on the device).
"""

import logging
from contextlib import nullcontext

import psutil
import torch
from yacs.config import CfgNode

from pycls_fast.components.precision import AmpMode
from pycls_fast.models import complexity
from pycls_fast.observe.goodput import Goodput
from pycls_fast.observe.logging import log_json_stats
from pycls_fast.observe.memory import memory_stats
from pycls_fast.observe.throughput import Throughput, device_peak_flops
from pycls_fast.runtime import distributed

logger = logging.getLogger(__name__)


class RunMetrics:
    """Throughput, memory, gradient norm and goodput of one training run."""

    def __init__(self, cfg: CfgNode, parts, iters_per_epoch: int, is_main: bool):
        self.iters = max(iters_per_epoch, 1)
        self.max_epoch = cfg.OPTIM.MAX_EPOCH
        dtype = torch.float32 if parts.mode is AmpMode.FP32 else parts.half_dtype
        peak = None
        if is_main:
            peak, source = device_peak_flops(parts.device, dtype, cfg.MFU.PEAK_TFLOPS)
            shown = f"{peak / 1e12:.1f} TFLOP/s" if peak else "unknown"
            logger.info("MFU against a peak of %s per device (%s)", shown, source)
        self.throughput = Throughput(
            complexity(cfg)["flops"],
            distributed.world_size(),
            peak,
            recompute=cfg.FSDP.ACTIVATION_CHECKPOINT,
        )
        self.goodput = None
        if is_main:
            started = psutil.Process().create_time()
            self.goodput = Goodput(cfg.OUT_DIR, started)

    def position(self, epoch: int, iteration: int) -> int:
        """The global iteration of (epoch, iterations into it)."""
        return epoch * self.iters + iteration

    def resumed_at(self, epoch: int, iteration: int) -> None:
        if self.goodput is not None:
            self.goodput.resumed_at(self.position(epoch, iteration))

    def span(self, name: str):
        """A context timing its block as `name` in the goodput account."""
        return self.goodput.span(name) if self.goodput is not None else nullcontext()

    def mark(self, epoch: int, iteration: int) -> None:
        """A checkpoint of this position is being written."""
        if self.goodput is not None:
            self.goodput.mark(self.position(epoch, iteration))
            self.goodput.save()

    def step_fields(self, parts, img_per_s: float) -> dict:
        """TFLOP/s, MFU, the last step's gradient norm (before clipping), the loss
        scale and the memory figures (reads the norm from the device)."""
        norm = getattr(parts, "grad_norm", None)
        return {
            **self.throughput.fields(img_per_s),
            "grad_norm": float(norm) if norm is not None else 0.0,
            "loss_scale": parts.scaler.scale_value,
            **memory_stats(parts.device),
        }

    def goodput_fields(self, epoch: int, done: int, data_wait_s: float) -> dict:
        """After `done` iterations of `epoch`, with `data_wait_s` waited for batches
        in this epoch so far: the account's fields (saved to OUT_DIR/goodput.json);
        {} on other ranks."""
        if self.goodput is None:
            return {}
        self.goodput.data_wait(data_wait_s)
        self.goodput.progress(self.position(epoch, done))
        self.goodput.save()
        return self.goodput.fields()

    def finish(self) -> None:
        """Logs the run's goodput (a `goodput` stats record: a human line on a
        terminal) and saves the account."""
        if self.goodput is None:
            return
        epoch = min(self.goodput.position // self.iters, self.max_epoch)
        self.goodput.save()
        log_json_stats(
            {
                "_type": "goodput",
                "epoch": f"{epoch}/{self.max_epoch}",
                **self.goodput.fields(),
            }
        )
