"""Timing of the training step, evaluation, the loader, and the device's matmul peak.

What tools/time_net.py reports (benchmarks/ladder.py uses it too). Step and evaluation
times are medians over `iters` calls after `warmup` untimed ones, on synthetic batches
(the loader is timed on its own), so the figures isolate compute from data. Forward,
forward+backward and the full step are timed interleaved (one of each per round,
after the same warm-up), so they compare under the same machine state.

With a `budget_s`, one untimed probe call sizes the counts: `warmup` and `iters` are
scaled down so that the phase takes about `budget_s` (at least one timed call).
`progress` (a callable taking one line) hears what each phase will take.
"""

import statistics
import tempfile
import time
from collections.abc import Callable

import torch

from pycls_fast.components.precision import AmpMode, input_dtype
from pycls_fast.config import with_overrides
from pycls_fast.datasets.formats.synthetic import make_image_folder
from pycls_fast.datasets.loader import ImageLoader, construct_train_loader
from pycls_fast.engine.model_setup import Components
from pycls_fast.engine.step import eval_forward, train_step
from pycls_fast.engine.step import forward_backward as trainer_forward_backward

IMAGENET_TRAIN_IMAGES = 1_281_167


Progress = Callable[[str], None] | None


def sync(device: torch.device) -> None:
    """Waits for `device` and for the current CUDA device when it is another one
    (work queued on either counts; unused GPUs are left alone: a sync would create
    a context there)."""
    if device.type != "cuda":
        return
    torch.cuda.synchronize(device)
    current = torch.cuda.current_device()
    if device.index is not None and device.index != current:
        torch.cuda.synchronize(current)


def _seconds(fn: Callable[[], object], device: torch.device) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def fit_budget(
    seconds_per_call: float, warmup: int, iters: int, budget_s: float | None
) -> tuple[int, int]:
    """(warmup, iters) scaled down so that warmup + iters calls of
    `seconds_per_call` take about `budget_s` (None: unchanged); at least one timed
    call, and one warm-up call when there is room for it."""
    if budget_s is None or (warmup + iters) * seconds_per_call <= budget_s:
        return warmup, iters
    calls = max(1, int(budget_s / max(seconds_per_call, 1e-9)))
    iters = max(1, min(iters, calls - min(warmup, 1)))
    return min(warmup, max(0, calls - iters)), iters


def _say(progress: Progress, line: str) -> None:
    if progress is not None:
        progress(line)


def _plan(name, per_call, warmup, iters, budget_s, progress):
    """Fits the counts to the budget and announces the phase."""
    warmup, iters = fit_budget(per_call, warmup, iters, budget_s)
    expected = (warmup + iters) * per_call
    line = (
        f"{name}: {warmup} warm-up + {iters} timed calls of ~{per_call:.2f} s, "
        f"~{expected:.0f} s"
    )
    if expected > 120:
        line += " (minutes: lower the batch size or --seconds to go faster)"
    _say(progress, line)
    return warmup, iters


def _compile_first(cfg, name, fns, progress):
    """With TRAIN.COMPILE, one untimed call of each of `fns` first: compilation is
    paid once per run, so it stays out of the probe, the budget and the times."""
    if cfg.TRAIN.COMPILE == "off" and not cfg.TRAIN.CUDA_GRAPHS:
        return
    how = (
        "TRAIN.CUDA_GRAPHS True"
        if cfg.TRAIN.CUDA_GRAPHS
        else f"TRAIN.COMPILE {cfg.TRAIN.COMPILE}"
    )
    _say(progress, f"{name}: compiling ({how}), untimed")
    start = time.perf_counter()
    for fn in fns:
        fn()
    _say(progress, f"{name}: compiled in {time.perf_counter() - start:.0f} s")


def _median_time(
    fn: Callable[[], object],
    device: torch.device,
    warmup: int,
    iters: int,
    budget_s: float | None = None,
    progress: Progress = None,
    name: str = "",
) -> float:
    if budget_s is not None:
        # The probe is the first warm-up call (it also pays for first-call costs).
        per_call = _seconds(fn, device)
        if 2 * per_call > budget_s:
            _say(
                progress,
                f"{name}: one call takes {per_call:.1f} s, over its "
                f"{budget_s:.0f} s share: that call is the figure (no warm-up)",
            )
            return per_call
        warmup, iters = _plan(name, per_call, warmup, iters, budget_s, progress)
        warmup = max(0, warmup - 1)
    for _ in range(warmup):
        fn()
    return statistics.median(_seconds(fn, device) for _ in range(iters))


def reset_peak_memory(device: torch.device) -> None:
    """Starts a new peak-memory window on a CUDA `device` (no-op elsewhere)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_mb(device: torch.device) -> float | None:
    """Peak bytes allocated on a CUDA `device` since the last reset, in MB; None
    elsewhere (a CPU has no such counter: see host RSS)."""
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 2**20


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
    parts: Components,
    batch_size: int,
    warmup: int,
    iters: int,
    budget_s: float | None = None,
    progress: Progress = None,
) -> dict[str, float | None]:
    """Returns {fwd_s, fwd_bwd_s, step_s} per iteration (medians of interleaved
    rounds) and gpu_peak_mb (peak CUDA memory of these calls; None on a CPU)."""
    cfg = parts.cfg
    inputs, targets = synthetic_batch(parts, batch_size, cfg.TRAIN.IM_SIZE)
    model, device = parts.trained, parts.device
    model.train()

    def forward() -> None:
        with torch.no_grad(), parts.autocast():
            eval_forward(parts, parts.model, inputs)

    def forward_backward() -> None:
        trainer_forward_backward(parts, inputs, targets)
        for p in parts.opt_params:
            p.grad = None
        for p in model.parameters():
            p.grad = None

    def step() -> None:
        train_step(parts, inputs, targets)

    phases = {"fwd_s": forward, "fwd_bwd_s": forward_backward, "step_s": step}
    _compile_first(cfg, "train", phases.values(), progress)
    reset_peak_memory(device)
    if budget_s is not None:
        # One probe round: first-call costs, and the size of a round.
        probe = {name: _seconds(fn, device) for name, fn in phases.items()}
        per_round = sum(probe.values())
        if 2 * per_round > budget_s:
            _say(
                progress,
                f"train: one round takes {per_round:.1f} s, over its "
                f"{budget_s:.0f} s share: that round is the figure (no warm-up)",
            )
            return {**probe, "gpu_peak_mb": peak_memory_mb(device)}
        warmup, iters = _plan(
            "train (forward, forward+backward, step)",
            per_round,
            warmup,
            iters,
            budget_s,
            progress,
        )
        warmup = max(0, warmup - 1)
    for _ in range(warmup):
        for fn in phases.values():
            fn()
    times = {name: [] for name in phases}
    for _ in range(iters):
        for name, fn in phases.items():
            times[name].append(_seconds(fn, device))
    out = {name: statistics.median(t) for name, t in times.items()}
    out["gpu_peak_mb"] = peak_memory_mb(device)
    return out


def time_test(
    parts: Components,
    batch_size: int,
    warmup: int,
    iters: int,
    budget_s: float | None = None,
    progress: Progress = None,
) -> float:
    """Returns the median seconds of one evaluation batch."""
    inputs, _ = synthetic_batch(parts, batch_size, parts.cfg.TRAIN.IM_SIZE, train=False)
    model = parts.trained
    model.eval()

    def forward() -> None:
        with torch.no_grad(), parts.autocast():
            eval_forward(parts, parts.model, inputs)

    name = f"evaluation (batch {batch_size})"
    _compile_first(parts.cfg, name, [forward], progress)
    seconds = _median_time(
        forward, parts.device, warmup, iters, budget_s, progress, name
    )
    model.train()
    return seconds


def time_loader(
    loader: ImageLoader,
    batches: int,
    warmup: int = 2,
    budget_s: float | None = None,
) -> float:
    """Images per second the loader delivers, over `batches` after `warmup` (fewer
    when `budget_s` seconds have passed)."""
    loader.set_epoch(0)
    it = iter(loader)
    try:
        for _ in range(warmup):
            next(it)
    except StopIteration:
        raise ValueError("the loader has fewer batches than the warm-up") from None
    images, start = 0, time.perf_counter()
    for _ in range(batches):
        try:
            imgs, _ = next(it)
        except StopIteration:
            break
        images += len(imgs)
        if budget_s is not None and time.perf_counter() - start > budget_s:
            break
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


def loader_throughput(
    cfg, batches: int, budget_s: float | None = None, progress: Progress = None
) -> tuple[float, str]:
    """(images/s, what was read) of the train loader of `cfg` over `batches`: on
    DATA.PATH, or without one on a temporary folder of synthetic JPEGs (500x375)
    large enough for every rank's shard (tools/time_net.py, tools/check_node.py)."""
    if cfg.DATA.PATH:
        _say(progress, f"loader: up to {batches} batches on {cfg.DATA.PATH}")
        loader = construct_train_loader(cfg)
        return time_loader(loader, batches, budget_s=budget_s), cfg.DATA.PATH
    images = cfg.TRAIN.BATCH_SIZE * (batches + 2)
    _say(progress, f"loader: writing {images} JPEGs, then up to {batches} batches")
    with tempfile.TemporaryDirectory() as root:
        make_image_folder(root, splits=("train",), num_classes=4,
                          images_per_class=-(-images // 4))  # fmt: skip
        synthetic = with_overrides(cfg, {"DATA.PATH": root, "DATA.INDEX_CACHE": False})
        loader = construct_train_loader(synthetic)
        rate = time_loader(loader, batches, budget_s=budget_s)
    return rate, "synthetic JPEGs (500x375)"
