#!/usr/bin/env python3
"""Measures the training step and the loader; projects the ImageNet-1k epoch time.

    python tools/time_net.py --cfg FILE [--json] [--loader-batches N] [KEY VALUE ...]
    python tools/time_net.py --run OUT_DIR ...     # the config of a run

Reports forward, forward+backward and full-step times on synthetic batches of
TRAIN.BATCH_SIZE / processes, evaluation throughput, the loader's images/s on
DATA.PATH (or, when DATA.PATH is empty, on a temporary folder of photo-like JPEGs of
ImageNet size), the model FLOP utilization (MFU) against the matmul peak of this device
and dtype measured in the same run, and the projected time of one ImageNet-1k epoch
(1,281,167 images) at the slower of the step and the loader (what a run adds to that:
evaluation, checkpoints and a log line every LOG_PERIOD steps, the only steps that read
a value back from the device). With --json the last line
is one JSON object of these figures.

Keeps to a time budget (--seconds, default 60): one untimed call per phase sizes its
warm-up and timed counts (PREC_TIME.WARMUP_ITER / NUM_ITER are upper bounds), and a
line per phase on stderr says what it will take. A DATA.PATH that does not exist is
refused at once (leave DATA.PATH empty to time the loader on generated JPEGs).

Runs as train_net does: one process, `NUM_GPUS N`, or under torchrun. With
`--parallel ddp,fsdp` it instead times the training step of DDP and of FSDP side by
side (interleaved rounds, medians) and reports per-rank and total img/s, the
parameter + optimizer-state bytes each rank holds, each rank's peak host RSS and, on
CUDA, each rank's peak GPU memory:

    torchrun --nproc_per_node 2 tools/time_net.py --cfg FILE --parallel ddp,fsdp

With `--infer` it instead measures inference: images/s against batch size (a batch
that does not fit in device memory is retried smaller), at the config's AMP mode and
TRAIN.COMPILE, ours and timm's VisionTransformer of the same shape taking turns
(--rounds, medians, the ratio), in one process; --csv FILE writes the rows with
timm's benchmark.py column names:

    python tools/time_net.py --cfg FILE --infer --batch-sizes 1,64,256 --csv infer.csv
"""

import csv
import functools
import json
import os
import platform
import resource
import statistics
import sys
import time

import torch

from pycls_fast.components.precision import apply_backend_flags, describe_precision
from pycls_fast.config import with_overrides
from pycls_fast.datasets.loader import check_data
from pycls_fast.engine import inference, timing
from pycls_fast.engine.trainer import (
    build_components,
    seed_everything,
    train_step,
)
from pycls_fast.errors import UserError
from pycls_fast.launch.cli import cfg_from_args, config_parser, run
from pycls_fast.launch.processes import launch
from pycls_fast.models import complexity
from pycls_fast.parallel.data_parallel import state_bytes
from pycls_fast.runtime import distributed

# Shares of --seconds: the train step, evaluation, the loader (the matmul peak and
# the model build take the rest).
SHARES = {"train": 0.45, "test": 0.2, "loader": 0.2}


def config_name(args):
    """What the timed config is called: its file, or the run it came from."""
    if args.cfg_file:
        return args.cfg_file
    return f"{os.path.join(args.run, 'config.yaml')} (--run)"


def progress(line):
    """One line of progress on stderr (rank 0)."""
    if distributed.is_main():
        print(f"time_net: {line}", file=sys.stderr, flush=True)


def _step_seconds(parts, inputs, targets, iters):
    """Median seconds of `iters` training steps (every rank steps in lockstep)."""
    times = []
    for _ in range(iters):
        timing.sync(parts.device)
        start = time.perf_counter()
        train_step(parts, inputs, targets)
        timing.sync(parts.device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def compare_parallel(cfg, modes, rounds):
    """Times the training step of each of `modes` ('ddp', 'fsdp') on this rank,
    interleaved over `rounds`; returns one record per mode, with every rank's figures
    (on rank 0)."""
    apply_backend_flags(cfg)
    world = distributed.world_size()
    batch = cfg.TRAIN.BATCH_SIZE // world
    built = {}
    for mode in modes:
        # The precision stays the compared config's (pycls's FSDP.MIXED_PRECISION
        # alias would otherwise follow FSDP.ENABLED).
        variant = with_overrides(
            cfg, {"FSDP.ENABLED": mode == "fsdp", "AMP.MODE": cfg.AMP.MODE}
        )
        seed_everything(cfg.RNG_SEED)
        built[mode] = build_components(variant, loaders=False)
    times = {mode: [] for mode in modes}
    gpu_peak = {mode: None for mode in modes}
    for r in range(rounds):
        progress(f"--parallel: round {r + 1} of {rounds}")
        for mode in modes:
            parts = built[mode]
            inputs, targets = timing.synthetic_batch(parts, batch, cfg.TRAIN.IM_SIZE)
            if r == 0:
                _step_seconds(parts, inputs, targets, cfg.PREC_TIME.WARMUP_ITER)
            # This mode's steps only (the other mode's model stays resident).
            timing.reset_peak_memory(parts.device)
            times[mode].append(
                _step_seconds(parts, inputs, targets, cfg.PREC_TIME.NUM_ITER)
            )
            peak = timing.peak_memory_mb(parts.device)
            if peak is not None:
                gpu_peak[mode] = max(peak, gpu_peak[mode] or 0.0)
    records = []
    for mode in modes:
        step = statistics.median(times[mode])
        # After a step: zero_grad has freed the gradients, so this is parameters +
        # optimizer state (tests/test_distributed.py counts gradients too).
        sizes = state_bytes(built[mode].model, built[mode].optimizer)
        mine = {
            "img_per_s": batch / step,
            "state_mb": sizes["total"] / 2**20,
            # Host memory, not GPU memory. Linux reports ru_maxrss in KB; both modes
            # live in this one process.
            "host_peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            / 1024,
            "gpu_peak_mb": gpu_peak[mode],
        }
        ranks = distributed.all_gather_object(mine)
        records.append(
            {
                "mode": mode if world > 1 or mode == "fsdp" else "one process",
                "processes": world,
                "batch_per_process": batch,
                "step_ms": 1e3 * step,
                "total_img_per_s": sum(r["img_per_s"] for r in ranks),
                "per_rank_img_per_s": [r["img_per_s"] for r in ranks],
                "per_rank_state_mb": [r["state_mb"] for r in ranks],
                "per_rank_host_peak_rss_mb": [r["host_peak_rss_mb"] for r in ranks],
                "per_rank_gpu_peak_mb": [r["gpu_peak_mb"] for r in ranks],
            }
        )
    return records


def print_parallel(records, args):
    for r in records:
        rates = ", ".join(f"{x:.1f}" for x in r["per_rank_img_per_s"])
        states = ", ".join(f"{x:.1f}" for x in r["per_rank_state_mb"])
        rss = ", ".join(f"{x:.0f}" for x in r["per_rank_host_peak_rss_mb"])
        gpu = ""
        if any(x is not None for x in r["per_rank_gpu_peak_mb"]):
            peaks = ", ".join(f"{x or 0:.0f}" for x in r["per_rank_gpu_peak_mb"])
            gpu = f"; GPU peak per rank: {peaks} MB"
        print(
            f"{r['mode']:>11}: {r['total_img_per_s']:.1f} img/s in total over "
            f"{r['processes']} process(es) (per rank: {rates}); step "
            f"{r['step_ms']:.1f} ms; parameters + optimizer state per rank: "
            f"{states} MB; peak host RSS per rank: {rss} MB{gpu}"
        )
    if args.json:
        print(json.dumps({"config": config_name(args), "parallel": records}))


def main():
    parser = config_parser(
        "Time the training step and the loader; project epoch time.", run=True
    )
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    parser.add_argument(
        "--loader-batches", type=int, default=8, help="batches to time the loader on"
    )
    parser.add_argument("--no-loader", action="store_true", help="skip the loader")
    parser.add_argument(
        "--parallel",
        default="",
        help="compare data-parallel modes instead, e.g. 'ddp,fsdp' (under torchrun "
        "or with NUM_GPUS N)",
    )
    parser.add_argument(
        "--rounds", type=int, default=5, help="interleaved rounds for --parallel"
    )
    parser.add_argument(
        "--infer", action="store_true", help="measure inference against batch size"
    )
    parser.add_argument(
        "--batch-sizes",
        default="",
        help="--infer: comma-separated batch sizes (default: TEST.BATCH_SIZE)",
    )
    parser.add_argument("--csv", help="--infer: write the rows to this CSV file")
    parser.add_argument(
        "--no-timm", action="store_true", help="--infer: ours only, no timm peer"
    )
    parser.add_argument(
        "--seconds",
        type=float,
        default=60.0,
        help="time budget of the measurement (iteration counts are scaled to it)",
    )
    args = parser.parse_args()
    cfg = cfg_from_args(args)
    if args.infer:
        return infer(cfg, args)
    if args.loader_batches < 1 or args.rounds < 1:
        raise UserError("--loader-batches and --rounds must be >= 1")
    if args.seconds <= 0:
        raise UserError("--seconds must be > 0")
    if cfg.DATA.PATH and not args.no_loader:
        try:
            check_data(cfg, ("train",))
        except UserError as e:
            raise UserError(
                f"{e}: set DATA.PATH '' to time the loader on generated JPEGs, or "
                "pass --no-loader"
            ) from None
    if args.parallel:
        modes = [m.strip() for m in args.parallel.split(",") if m.strip()]
        bad = [m for m in modes if m not in ("ddp", "fsdp")]
        if bad or not modes:
            raise UserError(f"--parallel takes 'ddp', 'fsdp' or both, got {bad}")
        # FSDP.ENABLED so that one process gets a process group too.
        cfg = with_overrides(cfg, {"FSDP.ENABLED": "fsdp" in modes})
        records = launch(
            functools.partial(compare_parallel, modes=modes, rounds=args.rounds), cfg
        )
        if records is not None:  # rank 0
            print_parallel(records, args)
        return
    record = launch(functools.partial(measure, args=args), cfg)
    if record is not None:
        report(record, args)


def _batch_sizes(text, default):
    try:
        sizes = [int(b) for b in text.split(",") if b.strip()] if text else [default]
    except ValueError:
        raise UserError(
            f"--batch-sizes: expected integers like 1,64,256: {text}"
        ) from None
    if not sizes or min(sizes) < 1:
        raise UserError(f"--batch-sizes: sizes must be >= 1: {text}")
    return sizes


def infer(cfg, args):
    """--infer: the inference rows of ours and timm's, printed (and written as CSV)."""
    sizes = _batch_sizes(args.batch_sizes, cfg.TEST.BATCH_SIZE)
    apply_backend_flags(cfg)
    seed_everything(cfg.RNG_SEED)
    device = distributed.device()
    models = inference.build_models(cfg, device, timm_peer=not args.no_timm)
    progress(f"inference: batch sizes {sizes}, {args.rounds} interleaved rounds")
    rows = inference.measure_inference(cfg, models, sizes, device, rounds=args.rounds)
    print(
        f"{args.cfg_file or args.run} on {device} ({rows[0]['amp']}, "
        f"compile {cfg.TRAIN.COMPILE}), torch {torch.__version__}, "
        f"{platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} threads"
    )
    print(inference.format_rows(rows))
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=inference.CSV_FIELDS)
            writer.writeheader()
            writer.writerows(rows)
        print(f"wrote {args.csv}")
    if args.json:
        print(json.dumps(rows))


def measure(cfg, args):
    """The step, evaluation, loader and MFU figures of this config (this rank)."""
    apply_backend_flags(cfg)
    seed_everything(cfg.RNG_SEED)
    parts = build_components(cfg, loaders=False)
    # Data-parallel replicas: each holds a batch; with TP / PP a replica spans
    # TP x PP processes (the "processes" of the figures below are replicas).
    world = parts.layout.dp
    devices = parts.layout.tp * parts.layout.pp
    batch = cfg.TRAIN.BATCH_SIZE // world
    warmup, iters = cfg.PREC_TIME.WARMUP_ITER, cfg.PREC_TIME.NUM_ITER
    budget = {k: share * args.seconds for k, share in SHARES.items()}
    train = timing.time_train(parts, batch, warmup, iters, budget["train"], progress)
    test_batch = cfg.TEST.BATCH_SIZE // world
    test_s = timing.time_test(
        parts, test_batch, warmup, iters, budget["test"], progress
    )
    loader_rate, loader_on = (None, None)
    if not args.no_loader:
        loader_rate, loader_on = timing.loader_throughput(
            cfg, args.loader_batches, budget["loader"], progress
        )
    dtype = timing.compute_dtype(parts)
    progress(f"matmul peak ({str(dtype).replace('torch.', '')})")
    peak = timing.matmul_peak_flops(parts.device, dtype)
    flops = complexity(cfg)["flops"]  # multiply-adds per image, forward
    train_rate = batch / train["step_s"] * world
    achieved = timing.train_flops(flops, batch) / train["step_s"] / devices
    bottleneck = min(train_rate, loader_rate * world) if loader_rate else train_rate
    record = {
        "config": config_name(args),
        "device": str(parts.device),
        "precision": describe_precision(parts.mode, parts.half_dtype),
        "batch_per_process": batch,
        "processes": world,
        "fwd_ms": 1e3 * train["fwd_s"],
        "fwd_bwd_ms": 1e3 * train["fwd_bwd_s"],
        "step_ms": 1e3 * train["step_s"],
        "gpu_peak_mb": train["gpu_peak_mb"],
        "train_img_per_s": train_rate,
        "test_img_per_s": test_batch / test_s * world,
        "loader_img_per_s": loader_rate * world if loader_rate else None,
        "model_gflops_per_img": 2 * flops / 1e9,
        "achieved_tflops": achieved / 1e12,
        "matmul_peak_tflops": peak / 1e12,
        "matmul_dtype": str(dtype).replace("torch.", ""),
        "mfu": achieved / peak,
        "epoch_time_s": timing.IMAGENET_TRAIN_IMAGES / bottleneck,
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "loader_on": loader_on,
    }
    return record


def report(record, args):
    r = record
    batch, world, train_rate = (
        r["batch_per_process"],
        r["processes"],
        r["train_img_per_s"],
    )
    loader_rate, loader_on = r["loader_img_per_s"], r.pop("loader_on")
    print(f"{r['config']} on {r['device']} ({r['precision']}), batch {batch} x {world}")
    print(
        f"  forward {r['fwd_ms']:.1f} ms, forward+backward {r['fwd_bwd_ms']:.1f} ms, "
        f"full step {r['step_ms']:.1f} ms (interleaved medians)"
    )
    if r["step_ms"] < r["fwd_bwd_ms"]:
        # The step adds the optimizer to forward+backward: shorter means noise.
        print("  (full step below forward+backward: the two are within timing noise)")
    if r["gpu_peak_mb"] is not None:
        print(f"  GPU peak memory of the train step: {r['gpu_peak_mb']:.0f} MB")
    print(f"  train {train_rate:.1f} img/s, test {record['test_img_per_s']:.1f} img/s")
    if loader_rate:
        print(f"  loader {loader_rate:.1f} img/s on {loader_on}")
    print(
        f"  {r['achieved_tflops']:.3f} TFLOP/s of a measured "
        f"{r['matmul_peak_tflops']:.3f} TFLOP/s {r['matmul_dtype']} matmul peak: "
        f"MFU {100 * r['mfu']:.1f}%"
    )
    hours = record["epoch_time_s"] / 3600
    # What a run adds: a log line (one host read) every LOG_PERIOD steps, the
    # checkpoints and the evaluation; its steps read nothing back otherwise.
    print(
        f"  projected ImageNet-1k epoch: {hours:.2f} h (training steps and loader only:"
        " not evaluation, checkpoints or the log line every LOG_PERIOD steps)"
    )
    if args.json:
        print(json.dumps(record))


if __name__ == "__main__":
    run(main)
