"""Timing of the training step, evaluation, the loader, and the device's matmul peak.

What tools/time_net.py reports (benchmarks/ladder.py uses it too). Step and evaluation
times are medians over `iters` calls after `warmup` untimed ones, on synthetic batches
(the loader is timed on its own), so the figures isolate compute from data.
"""

import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pycls_fast.core.precision import AmpMode, autocast, input_dtype
from pycls_fast.core.trainer import Components, train_step
from pycls_fast.datasets.loader import ImageLoader

IMAGENET_TRAIN_IMAGES = 1_281_167


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_time(
    fn: Callable[[], object], device: torch.device, warmup: int, iters: int
) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def synthetic_batch(
    parts: Components, batch_size: int, im_size: int, train: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """A device batch as the loader + device prep would make it (normalized)."""
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (batch_size, 3, im_size, im_size), generator=g)
    labels = torch.randint(0, parts.cfg.MODEL.NUM_CLASSES, (batch_size,), generator=g)
    prep = parts.train_prep if train else parts.test_prep
    if prep is not None:
        return prep(images.to(torch.uint8), labels)
    dtype = input_dtype(parts.mode, parts.half_dtype)
    inputs = (images.float() / 255.0 - 0.45) / 0.225
    return inputs.to(parts.device, dtype), labels.to(parts.device)


def time_train(
    parts: Components, batch_size: int, warmup: int, iters: int
) -> dict[str, float]:
    """Returns {fwd_s, fwd_bwd_s, step_s} per iteration (medians)."""
    cfg = parts.cfg
    inputs, targets = synthetic_batch(parts, batch_size, cfg.TRAIN.IM_SIZE)
    model, device = parts.trained, parts.device
    model.train()

    def forward():
        with torch.no_grad(), autocast(device.type, parts.mode, parts.half_dtype):
            model(inputs)

    def forward_backward():
        with autocast(device.type, parts.mode, parts.half_dtype):
            loss = F.cross_entropy(model(inputs).float(), targets)
        loss.backward()
        for p in model.parameters():
            p.grad = None

    def step():
        train_step(parts, inputs, targets)

    return {
        "fwd_s": _median_time(forward, device, warmup, iters),
        "fwd_bwd_s": _median_time(forward_backward, device, warmup, iters),
        "step_s": _median_time(step, device, warmup, iters),
    }


def time_test(parts: Components, batch_size: int, warmup: int, iters: int) -> float:
    """Returns the median seconds of one evaluation batch."""
    inputs, _ = synthetic_batch(parts, batch_size, parts.cfg.TRAIN.IM_SIZE, train=False)
    model = parts.trained
    model.eval()

    def forward():
        with torch.no_grad(), autocast(parts.device.type, parts.mode, parts.half_dtype):
            model(inputs)

    seconds = _median_time(forward, parts.device, warmup, iters)
    model.train()
    return seconds


def time_loader(loader: ImageLoader, batches: int, warmup: int = 2) -> float:
    """Images per second the loader delivers, over `batches` after `warmup`."""
    loader.set_epoch(0)
    it = iter(loader)
    for _ in range(warmup):
        next(it)
    images, start = 0, time.perf_counter()
    for _ in range(batches):
        try:
            imgs, _ = next(it)
        except StopIteration:
            break
        images += len(imgs)
    elapsed = time.perf_counter() - start
    if hasattr(it, "close"):
        it.close()
    return images / elapsed if elapsed > 0 else 0.0


def matmul_peak_flops(
    device: torch.device, dtype: torch.dtype, size: int | None = None, iters: int = 10
) -> float:
    """Measured FLOP/s of a large square matmul in `dtype` on `device` (the peak the
    MFU is taken against: same run, same machine state)."""
    size = size or (8192 if device.type == "cuda" else 2048)
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    seconds = _median_time(lambda: torch.mm(a, b), device, 2, iters)
    return 2.0 * size**3 / seconds


def train_flops(flops_per_image: float, batch_size: int) -> float:
    """Model FLOPs of one training step: forward multiply-adds x 2 FLOPs x 3 (forward,
    and a backward that costs two forwards), as MFU is conventionally counted."""
    return 3 * 2 * flops_per_image * batch_size


def compute_dtype(parts: Components) -> torch.dtype:
    """The dtype the matmuls run in: the half dtype in AMP modes, else fp32."""
    return torch.float32 if parts.mode is AmpMode.FP32 else parts.half_dtype
