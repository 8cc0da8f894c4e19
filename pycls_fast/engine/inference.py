"""Inference throughput: images/s of the model against batch size, at the config's
AMP mode (AMP.MODE / TRAIN.MIXED_PRECISION) and TRAIN.COMPILE, and timm's
VisionTransformer of the same shape side by side.

A batch that does not fit in device memory is retried smaller (timm's
`decay_batch_step`, as timm's benchmark.py does), and the row says which size ran.
The models take turns (A, B, A, B ...; each turn `iters` forwards), and each figure is
the median of its turns, so that drift of the machine falls on both alike. Rows carry
timm's benchmark.py CSV names (`model`, `infer_samples_per_sec`, `infer_step_time`,
`infer_batch_size`, `infer_img_size`) plus the AMP mode, the compile setting and, for
ours, the ratio to timm's.
"""

import math
import statistics
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn
from yacs.config import CfgNode

from pycls_fast.components.precision import (
    autocast,
    describe_precision,
    input_dtype,
    prepare_model,
    resolve_amp,
)
from pycls_fast.engine.timing import sync
from pycls_fast.errors import UserError
from pycls_fast.models import build_model
from pycls_fast.models.timm_compat import build_timm_vit
from pycls_fast.parallel.data_parallel import apply_compile

OURS, TIMM = "pycls_fast", "timm"
CSV_FIELDS = [
    "model", "infer_samples_per_sec", "infer_step_time", "infer_batch_size",
    "infer_img_size", "requested_batch_size", "amp", "compile", "device",
    "ratio_to_timm",
]  # fmt: skip


def prepare_for_inference(
    model: nn.Module, cfg: CfgNode, device: torch.device
) -> nn.Module:
    """`model` on `device`, in eval mode, cast for the config's AMP mode and
    compiled per TRAIN.COMPILE ('block': each of ours or timm's blocks)."""
    mode, half = resolve_amp(cfg)
    model = prepare_model(model.to(device).eval(), mode, half, cfg.AMP.LAYER_NORM_FP32)
    if cfg.TRAIN.COMPILE == "block" and hasattr(model, "blocks"):  # timm's
        for block in model.blocks:
            block.compile()
    else:
        apply_compile(model, cfg.TRAIN.COMPILE)
    return model


def build_models(
    cfg: CfgNode, device: torch.device, timm_peer: bool = True
) -> dict[str, nn.Module]:
    """Ours (random weights: speed does not depend on them) and, with `timm_peer`,
    timm's VisionTransformer of the same shape, prepared for inference."""
    models = {OURS: prepare_for_inference(build_model(cfg), cfg, device)}
    if timm_peer:
        models[TIMM] = prepare_for_inference(build_timm_vit(cfg), cfg, device)
    return models


def _forward(model, inputs, cfg, device):
    mode, half = resolve_amp(cfg)

    def run() -> None:
        with torch.inference_mode(), autocast(device.type, mode, half):
            model(inputs)

    return run


def _inputs(cfg: CfgNode, batch_size: int, device: torch.device) -> torch.Tensor:
    mode, half = resolve_amp(cfg)
    g = torch.Generator().manual_seed(0)
    size = cfg.TRAIN.IM_SIZE
    x = torch.randn(batch_size, 3, size, size, generator=g)
    return x.to(device, input_dtype(mode, half))


def fitting_batch(try_batch: Callable[[int], None], batch_size: int) -> int:
    """The largest size from `batch_size` down timm's decay steps (256, 192, 128,
    96, ...) for which `try_batch(size)` runs without running out of device memory;
    UserError when not even one image fits."""
    from timm.utils import decay_batch_step

    size = batch_size
    while size >= 1:
        try:
            try_batch(size)
            return size
        except torch.OutOfMemoryError:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            size = decay_batch_step(size)
    raise UserError(f"not even a batch of 1 fits in device memory (from {batch_size})")


def _seconds(fn, device, iters):
    sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(device)
    return (time.perf_counter() - start) / iters


def measure_inference(
    cfg: CfgNode,
    models: dict[str, nn.Module],
    batch_sizes: Sequence[int],
    device: torch.device,
    rounds: int = 5,
    iters: int = 3,
    warmup: int = 2,
    min_turn_s: float = 0.05,
) -> list[dict]:
    """One row per (batch size, model): the median over `rounds` interleaved turns
    of at least `iters` forwards each, and as many more as fill `min_turn_s` (a
    batch-1 forward of a small model takes milliseconds: a turn of 3 would time
    the scheduler's slices as much as the model), after `warmup` untimed forwards
    (and compilation)."""
    mode, half = resolve_amp(cfg)
    rows = []
    for requested in batch_sizes:

        def try_batch(size: int) -> None:
            x = _inputs(cfg, size, device)
            for model in models.values():
                for _ in range(warmup or 1):
                    _forward(model, x, cfg, device)()
            sync(device)

        size = fitting_batch(try_batch, requested)
        x = _inputs(cfg, size, device)
        fns = {name: _forward(m, x, cfg, device) for name, m in models.items()}
        once = min(_seconds(fn, device, 1) for fn in fns.values())
        turn = max(iters, math.ceil(min_turn_s / max(once, 1e-9)))
        times = {name: [] for name in models}
        for _ in range(rounds):
            for name, fn in fns.items():
                times[name].append(_seconds(fn, device, turn))
        medians = {name: statistics.median(t) for name, t in times.items()}
        for name, seconds in medians.items():
            rows.append(
                {
                    "model": name,
                    "infer_samples_per_sec": size / seconds,
                    "infer_step_time": 1e3 * seconds,
                    "infer_batch_size": size,
                    "infer_img_size": cfg.TRAIN.IM_SIZE,
                    "requested_batch_size": requested,
                    "amp": describe_precision(mode, half),
                    "compile": cfg.TRAIN.COMPILE,
                    "device": str(device),
                    "ratio_to_timm": (
                        medians[TIMM] / seconds if TIMM in medians else None
                    ),
                }
            )
    return rows


def format_rows(rows: list[dict]) -> str:
    """The rows as a text table: batch, model, images/s, ms per batch, ratio."""
    lines = [
        "| batch | model | images/s | ms / batch | ours / timm |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = r["ratio_to_timm"]
        batch = str(r["infer_batch_size"])
        if r["infer_batch_size"] != r["requested_batch_size"]:
            batch += f" (of {r['requested_batch_size']}: memory)"
        lines.append(
            f"| {batch} | {r['model']} | {r['infer_samples_per_sec']:.1f} | "
            f"{r['infer_step_time']:.2f} | "
            + (f"{ratio:.2f} |" if ratio is not None and r["model"] == OURS else "|")
        )
    return "\n".join(lines)
