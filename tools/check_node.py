#!/usr/bin/env python3
"""Checks a new node before the first real run: one line per check, with a verdict.

    python tools/check_node.py [--cfg FILE] [--steps N] [--json] [--checks a,b]
        [KEY VALUE ...]

Checks: the device inventory; a short training in each AMP mode against fp32 (final
losses within --tolerance, relative); DDP against FSDP on all local devices (two gloo
processes on a CPU); all-reduce bus bandwidth (NCCL on GPUs, gloo on CPUs); the matmul
peak per dtype; the loader's images/s against what the training step of --cfg asks
for (one rank's step: its share of the global batch, TP and PP folded into one
process, FSDP in a one-process group), and the cores per GPU that --cfg's train
transform (its augmentation recipe) takes at that step's pace. A folded rank that
would not fit this device (--memory-gib; the planner's per-rank memory) is timed with
fewer encoder blocks and its step time scaled up by the blocks, said in the line; one
that does not fit with a single block is refused in one line. Each line ends in
`ok`, `warning` (with the fix) or `skipped` (with why). With --json the last line is
one JSON object: {"rows": [{check, result, verdict, fix}]}.
"""

import functools
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from pycls_fast.components.precision import apply_backend_flags
from pycls_fast.config import load_cfg, with_overrides
from pycls_fast.engine import timing
from pycls_fast.engine.trainer import build_components, seed_everything, train_step
from pycls_fast.errors import UserError
from pycls_fast.launch.cli import ArgumentParser, run
from pycls_fast.launch.processes import launch
from pycls_fast.parallel.planner import device_gib, fit_in_one_process
from pycls_fast.runtime import distributed
from pycls_fast.runtime.device_info import (
    cuda_unusable_reason,
    describe_device,
    outdated_warning,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_CFG = os.path.join(ROOT, "configs/examples/vit_tiny_cpu.yaml")
# The training checks use a tiny fixed model whatever --cfg says.
TINY = ["TRAIN.BATCH_SIZE", "16", "TEST.BATCH_SIZE", "16", "DATA.PATH", "",
        "OPTIM.WARMUP_EPOCHS", "0", "NUM_GPUS", "1"]  # fmt: skip


CHECKS = ("device", "amp", "parallel", "matmul", "loader")


def _row(check, result, verdict="ok", fix=""):
    return {"check": check, "result": result, "verdict": verdict, "fix": fix}


def _amp(mode):
    """The overrides of one AMP mode, pycls's aliases off: the checks set the mode
    themselves, and the config's TRAIN.MIXED_PRECISION is no mistake to warn of."""
    return {"AMP.MODE": mode, "TRAIN.MIXED_PRECISION": False,
            "FSDP.MIXED_PRECISION": False}  # fmt: skip


def _losses(cfg, steps):
    """Training losses of `steps` steps of `cfg` on one fixed synthetic batch."""
    seed_everything(cfg.RNG_SEED)
    parts = build_components(cfg, loaders=False)
    inputs, targets = timing.synthetic_batch(parts, 16, cfg.TRAIN.IM_SIZE)
    return [float(train_step(parts, inputs, targets)[0]) for _ in range(steps)]


def check_amp(cfg, steps, tolerance):
    """Each AMP mode's final loss against fp32's."""
    reference = _losses(with_overrides(cfg, _amp("fp32")), steps)[-1]
    rows = []
    for mode in ("O1", "O2", "O3"):
        loss = _losses(with_overrides(cfg, _amp(mode)), steps)[-1]
        gap = abs(loss - reference) / max(abs(reference), 1e-12)
        result = f"loss {loss:.4f} vs fp32 {reference:.4f} ({100 * gap:.1f}%)"
        ok = gap <= tolerance
        rows.append(
            _row(
                f"AMP {mode} ({cfg.AMP.DTYPE}) vs fp32, {steps} steps",
                result,
                "ok" if ok else "warning",
                "" if ok else f"more than {100 * tolerance:.0f}%: train with O1",
            )
        )
    return rows


def _parallel_worker(cfg, steps):
    """On every rank: DDP and FSDP losses, and the all-reduce bus bandwidth."""
    out = {}
    for mode in ("ddp", "fsdp"):
        variant = with_overrides(cfg, {"FSDP.ENABLED": mode == "fsdp", **_amp("fp32")})
        out[mode] = _losses(variant, steps)[-1]
    world = distributed.world_size()
    on = distributed.device() if dist.get_backend() == "nccl" else torch.device("cpu")
    size = (64 if on.type == "cuda" else 8) * 2**20  # bytes
    t = torch.ones(size // 4, device=on)
    times = []
    for i in range(6):
        timing.sync(on)
        start = time.perf_counter()
        dist.all_reduce(t)
        timing.sync(on)
        if i:  # the first call sets up the connections
            times.append(time.perf_counter() - start)
    # NCCL's bus bandwidth: what each link carries in a ring all-reduce.
    out["busbw_gbps"] = size * 2 * (world - 1) / world / statistics.median(times) / 1e9
    out["backend"] = dist.get_backend()
    out["world"] = world
    return out


def check_parallel(cfg, steps):
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus == 1:
        reason = "one GPU: DDP / FSDP parity and all-reduce need two devices"
        return [
            _row("DDP vs FSDP", reason, "skipped"),
            _row("all-reduce bus bandwidth", reason, "skipped"),
        ]
    world = gpus or 2
    backend = "nccl" if gpus else "gloo"
    opts = {"NUM_GPUS": world, "DIST_BACKEND": backend}
    opts["TRAIN.BATCH_SIZE"] = 16 * world
    opts["TEST.BATCH_SIZE"] = 16 * world
    worker = functools.partial(_parallel_worker, steps=steps)
    r = launch(worker, with_overrides(cfg, opts))
    gap = abs(r["ddp"] - r["fsdp"]) / max(abs(r["ddp"]), 1e-12)
    ok = gap <= 1e-3
    where = f"{world} {'GPUs' if gpus else 'CPU processes'}, {r['backend']}"
    bw_ok = not gpus or r["busbw_gbps"] >= 10
    return [
        _row(
            f"DDP vs FSDP, {where}, fp32, {steps} steps",
            f"loss {r['ddp']:.5f} vs {r['fsdp']:.5f} ({100 * gap:.3f}%)",
            "ok" if ok else "warning",
            "" if ok else "losses differ by more than 0.1%: report it",
        ),
        _row(
            f"all-reduce bus bandwidth, {where}",
            f"{r['busbw_gbps']:.2f} GB/s",
            "ok" if bw_ok else "warning",
            "" if bw_ok else "below 10 GB/s: check NVLink / NCCL_P2P_DISABLE / IB",
        ),
    ]


def check_matmul(device):
    rows = []
    size = 4096 if device.type == "cuda" else 512
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        flops = timing.matmul_peak_flops(device, dtype, size=size, iters=5)
        name = str(dtype).replace("torch.", "")
        rows.append(_row(f"matmul peak {name}", f"{flops / 1e12:.3f} TFLOP/s"))
    return rows


def one_rank_cfg(cfg):
    """The config of one data-parallel rank of `cfg`'s job, as one process: its
    share of the global TRAIN / TEST.BATCH_SIZE (over NUM_GPUS / (TP x PP) ranks),
    NUM_GPUS 1, and TP and PP 1 (one process holds no layer or stage split: the
    step is timed whole). FSDP stays as the config says (a one-process group)."""
    dp = cfg.NUM_GPUS // (cfg.PARALLEL.TP * cfg.PARALLEL.PP)
    return with_overrides(
        cfg,
        {
            "NUM_GPUS": 1,
            "PARALLEL.TP": 1,
            "PARALLEL.PP": 1,
            "PARALLEL.AUTO": False,
            "TRAIN.BATCH_SIZE": cfg.TRAIN.BATCH_SIZE // dp,
            "TEST.BATCH_SIZE": cfg.TEST.BATCH_SIZE // dp,
        },
    )


def recipe_cpu_ms(cfg, images: int = 48) -> float:
    """CPU ms per image of `cfg`'s train transform (read, decode, crop, augment) in a
    decoding thread, as the loader runs it, on ImageNet-sized photo-like JPEGs."""
    import random
    import tempfile
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    from pycls_fast.datasets.formats.index import scan_split
    from pycls_fast.datasets.formats.synthetic import make_image_folder
    from pycls_fast.datasets.images.decode import EncodedImage
    from pycls_fast.datasets.images.transforms import build_transform

    transform = build_transform(cfg, train=True)
    size = cfg.TRAIN.IM_SIZE

    def run(index):
        out = np.empty((size, size, 3), dtype=np.uint8)
        for i in range(len(index)):  # warm-up: buffers, page cache
            transform(EncodedImage(index.read(i)), random.Random(i), out)
        start = time.thread_time()
        for i in range(len(index)):
            transform(EncodedImage(index.read(i)), random.Random(i), out)
        return 1e3 * (time.thread_time() - start) / len(index)

    with tempfile.TemporaryDirectory() as root:
        make_image_folder(root, ("train",), 1, images, size="imagenet", seed=0)
        index = scan_split(os.path.join(root, "train"))
        with ThreadPoolExecutor(1) as pool:
            return pool.submit(run, index).result()


def loader_verdict(rate: float, demand: float) -> tuple[str, str]:
    """('ok', '') when the loader's img/s `rate` passes the step's `demand` by 20%
    (decoding time varies from image to image), else ('warning', what and the fix)."""
    if rate >= 1.2 * demand:
        return "ok", ""
    short = (
        "the loader would starve the step"
        if rate < demand
        else f"the loader keeps up with {rate / demand - 1:.0%} to spare, under 20%"
    )
    return "warning", (
        f"{short}: raise DATA_LOADER.NUM_WORKERS or give the job more CPU cores"
    )


def recipe_name(cfg) -> str:
    """The train transform's augmentations in a few words."""
    parts = ["crop + flip"]
    if cfg.TRAIN.THREE_AUGMENT:
        parts.append("3-Augment")
    if cfg.TRAIN.COLOR_JITTER:
        parts.append(f"colour jitter {cfg.TRAIN.COLOR_JITTER:g}")
    if cfg.TRAIN.AUGMENT:
        on_device = cfg.TRAIN.AUGMENT_BACKEND == "device"
        parts.append(cfg.TRAIN.AUGMENT + (" on the device" if on_device else ""))
    return " + ".join(parts)


def _loader_rates(cfg, steps):
    """(step demand in img/s, loader img/s, where it read, train transform CPU ms per
    image): on one rank's batch."""
    seed_everything(cfg.RNG_SEED)
    parts = build_components(cfg, loaders=False)
    batch = cfg.TRAIN.BATCH_SIZE
    train = timing.time_train(parts, batch, 1, steps, budget_s=20.0)
    rate, on = timing.loader_throughput(cfg, 2, budget_s=20.0)
    return batch / train["step_s"], rate, on, recipe_cpu_ms(cfg)


def cores_per_gpu() -> float:
    """This process's CPU cores per local GPU (all of them without a GPU)."""
    cores = len(os.sched_getaffinity(0))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return cores / max(gpus, 1)


def check_loader(cfg, cfg_file, steps, memory_gib=None):
    """One rank's loader images/s against its training step's demand (this config,
    at its per-rank batch; FSDP configs in a one-process group, via launch), and the
    cores per GPU its train transform takes at that demand. The folded rank is
    trimmed to the encoder blocks that fit `memory_gib` (default: this device's
    memory), its step time scaled back up by the blocks."""
    rank_cfg = one_rank_cfg(cfg)
    if memory_gib is None:
        memory_gib = device_gib(distributed.device(), 1)
    timed, layers = fit_in_one_process(rank_cfg, memory_gib)
    run = functools.partial(_loader_rates, steps=steps)
    demand, rate, on, cpu_ms = launch(run, timed)
    scaled = ""
    if layers > timed.VIT.NUM_LAYERS:
        # The blocks are the step: a whole rank's step takes about layers / n
        # times as long, and asks for that much fewer images per second.
        demand *= timed.VIT.NUM_LAYERS / layers
        scaled = (
            f" (timed at {timed.VIT.NUM_LAYERS} of {layers} blocks: the rank does "
            f"not fit {memory_gib:.0f} GiB folded into one process; step time "
            f"scaled by {layers}/{timed.VIT.NUM_LAYERS})"
        )
    verdict, fix = loader_verdict(rate, demand)
    cores, here = demand * cpu_ms / 1e3, cores_per_gpu()
    enough = cores <= here
    return [
        _row(
            f"loader vs step demand ({os.path.basename(cfg_file)}, "
            f"{rank_cfg.TRAIN.BATCH_SIZE} images per rank)",
            f"{rate:.0f} img/s on {on} vs {demand:.0f} img/s demand{scaled}",
            verdict,
            fix,
        ),
        _row(
            f"loader cores per GPU ({recipe_name(cfg)})",
            f"{cpu_ms:.2f} ms CPU per image x {demand:.0f} img/s = {cores:.1f} "
            f"cores per GPU ({here:.0f} here)",
            "ok" if enough else "warning",
            ""
            if enough
            else "this recipe's train transform needs more cores per GPU than the "
            "node has: the loader will hold the step back (docs/PERFORMANCE.md, "
            f"'Augmentation cost per recipe'){_device_hint(cfg)}",
        ),
    ]


def _device_hint(cfg) -> str:
    """The advice to move TRAIN.AUGMENT onto the GPU, where it would help."""
    if not cfg.TRAIN.AUGMENT or cfg.TRAIN.AUGMENT_BACKEND == "device":
        return ""
    if cfg.TRAIN.AUGMENT.startswith("augmix") or not torch.cuda.is_available():
        return ""
    return "; TRAIN.AUGMENT_BACKEND device runs TRAIN.AUGMENT on the GPU instead"


def print_table(rows):
    width = max(len(r["check"]) for r in rows)
    for r in rows:
        fix = f"  ({r['fix']})" if r["fix"] else ""
        print(f"{r['check']:<{width}}  {r['verdict']:<8} {r['result']}{fix}")


def main():
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cfg", dest="cfg_file", default=TINY_CFG)
    parser.add_argument("--steps", type=int, default=10, help="training steps")
    parser.add_argument("--tolerance", type=float, default=0.05)
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--memory-gib",
        type=float,
        default=None,
        help="the memory one device gives the --cfg rank (default: this device's)",
    )
    parser.add_argument(
        "--checks",
        default=",".join(CHECKS),
        help=f"the checks to run, of {','.join(CHECKS)} (default: all)",
    )
    parser.add_argument(
        "opts", nargs="*", help="overrides of --cfg (the loader check): KEY VALUE ..."
    )
    args = parser.parse_intermixed_args()
    if args.steps < 1:
        raise UserError("--steps must be >= 1")
    if args.memory_gib is not None and args.memory_gib <= 0:
        raise UserError("--memory-gib must be positive")
    chosen = [c for c in args.checks.split(",") if c]
    unknown = [c for c in chosen if c not in CHECKS]
    if unknown:
        raise UserError(f"--checks: unknown {unknown[0]!r}; known: {','.join(CHECKS)}")
    tiny = load_cfg(TINY_CFG, TINY)
    cfg = load_cfg(args.cfg_file, ["DATA.PATH", "", *args.opts])
    apply_backend_flags(tiny)
    device = distributed.device()
    reason = cuda_unusable_reason() or outdated_warning()
    rows = []
    start = time.monotonic()
    timed = [c for c in CHECKS if c in chosen and c != "device"]

    def phase(name: str) -> bool:
        """Whether check `name` runs; if so, a progress line on stderr first (the
        table comes at the end: the checks take a minute or more)."""
        if name not in chosen:
            return False
        done = time.monotonic() - start
        print(
            f"check_node: [{timed.index(name) + 1}/{len(timed)}] {name} "
            f"({done:.0f} s so far)",
            file=sys.stderr,
            flush=True,
        )
        return True

    if "device" in chosen:
        rows.append(
            _row(
                "device",
                describe_device(device),
                "warning" if reason else "ok",
                reason or "",
            )
        )
    if phase("amp"):
        rows += check_amp(tiny, args.steps, args.tolerance)
    if phase("parallel"):
        rows += check_parallel(tiny, args.steps)
    if phase("matmul"):
        rows += check_matmul(device)
    if phase("loader"):
        rows += check_loader(cfg, args.cfg_file, args.steps, args.memory_gib)
    if device.type == "cpu" and "device" in chosen:
        rows.append(_row("GPU checks", "no GPU: NCCL, TF32, GPU memory", "skipped"))
    print_table(rows)
    if args.json:
        print(json.dumps({"rows": rows}))


if __name__ == "__main__":
    run(main)
