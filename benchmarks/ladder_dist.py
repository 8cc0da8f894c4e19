"""The article's ladder, distributed: a DDP fp32 baseline and one optimization per
rung, on every process of a torchrun job, as accelerator throughput (model TFLOP/s per
device).

    torchrun --nproc_per_node 8 -m benchmarks.ladder_dist \\
        --cfg configs/vit/ViT-H-16.yaml --batch 560 --json-out out/ladder_8.json \\
        --plot-dir out/ladder [KEY VALUE ...]

Rungs (each keeps the ones before; `--batch` is the global batch, split over ranks):

  ddp           DDP, fp32, class token, batch-first, per-parameter optimizer loop
  amp           + AMP O1 (autocast to AMP.DTYPE, fp32 weights)
  fsdp          + FSDP2 (fully_shard per block and root) in place of DDP
  mta           + multi-tensor-apply optimizer (OPTIM.MTA)
  pooled        + pooled classifier
  batch_second  + batch-second token layout
  amp_o2        + AMP O2 (half-precision compute, fp32 master shards)
  im256         + images of --large-size px (256: the article's 224 -> 256)
  o3            + AMP O3 (weights, grads and optimizer in AMP.DTYPE; the article's
                  "full FP16" is AMP.DTYPE fp16)

Rungs run one after another (one model in memory at a time, as a GPU needs), each on
one synthetic batch: `--warmup` untimed steps, then `--rounds` x `--iters` timed steps;
a round's time is the slowest rank's; the median round is reported. Throughput is model
FLOP/s per device (3 x 2 x forward multiply-adds per image, `complexity`): at a fixed
image size its ratio is the images/s ratio, and it is what the article compares across
image sizes. The epoch time is ImageNet-1k's 1,281,167 images at the measured rate.
Rank 0 prints a table, writes the JSON record (--json-out) and the ladder and epoch-time
figures (--plot-dir); `python -m benchmarks.ladder_plots` makes the scaling figure from
several runs' records.
"""

import argparse
import gc
import json
import os
import platform
import statistics
import time

import torch

from benchmarks.ladder import BASELINE
from benchmarks.ladder_plots import plot_epoch_time, plot_ladder
from pycls_fast.components.precision import apply_backend_flags, fp32_math
from pycls_fast.config import load_cfg
from pycls_fast.engine import timing
from pycls_fast.engine.trainer import build_components, seed_everything, train_step
from pycls_fast.errors import UserError
from pycls_fast.launch.cli import run
from pycls_fast.launch.processes import (
    init_process_group,
    init_single_process_group,
    under_torchrun,
)
from pycls_fast.models import complexity
from pycls_fast.runtime import distributed

IMAGENET_TRAIN_IMAGES = 1_281_167

# (name, label, overrides added by this rung); each rung keeps the ones before.
RUNGS = [
    ("ddp", "DDP fp32 baseline", [*BASELINE, "FSDP.ENABLED", "False"]),
    ("amp", "+ AMP O1", ["AMP.MODE", "O1"]),
    ("fsdp", "+ FSDP", ["FSDP.ENABLED", "True"]),
    ("mta", "+ MTA optimizer", ["OPTIM.MTA", "True"]),
    ("pooled", "+ pooled classifier", ["VIT.CLASSIFIER_TYPE", "pooled"]),
    ("batch_second", "+ batch-second", ["VIT.LAYOUT", "batch_second"]),
    ("amp_o2", "+ AMP O2", ["AMP.MODE", "O2"]),
    ("im256", "+ larger images", []),  # TRAIN.IM_SIZE from --large-size
    ("o3", "+ AMP O3", ["AMP.MODE", "O3"]),
]
# Rungs that change the task (image size, precision of the weights): the "optimized"
# epoch time is the last rung without them, as the article's 0.65 h -> 0.43 h.
OTHER_TASK = ("im256", "o3")


def _parser():
    p = argparse.ArgumentParser(
        prog="torchrun --nproc_per_node N -m benchmarks.ladder_dist",
        description="The optimization ladder over a DDP fp32 baseline, on every "
        "process of a torchrun job: TFLOP/s per device, epoch time, figures.",
        epilog="KEY VALUE pairs override config keys of --cfg (see docs/CONFIG.md).",
    )
    p.add_argument("--cfg", dest="cfg_file", required=True, help="config file")
    p.add_argument(
        "--batch", type=int, default=0, help="global batch (TRAIN.BATCH_SIZE)"
    )
    p.add_argument("--rounds", type=int, default=3, help="timed rounds (3)")
    p.add_argument("--iters", type=int, default=3, help="steps per round (3)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (2)")
    p.add_argument("--large-size", type=int, default=256, help="im256 rung's size")
    names = ",".join(name for name, _, _ in RUNGS)
    p.add_argument("--steps", default=names, help=f"rungs to run ({names})")
    p.add_argument("--json-out", default="", help="write the JSON record here")
    p.add_argument("--plot-dir", default="", help="write the two figures here")
    p.add_argument("opts", nargs="*", help="config overrides: KEY VALUE ...")
    p.parse_args = p.parse_intermixed_args
    return p


def rung_configs(cfg_file, opts, batch, world, large_size):
    """[(name, label, cfg)] of every rung, each with the overrides before it."""
    common = list(opts) + ["NUM_GPUS", str(world)]
    if batch:
        common += ["TRAIN.BATCH_SIZE", str(batch)]
    out, overrides = [], []
    for name, label, extra in RUNGS:
        if name == "im256":
            extra = ["TRAIN.IM_SIZE", str(large_size)]
            label = f"+ {large_size} px images"
        overrides = overrides + extra
        out.append((name, label, load_cfg(cfg_file, common + overrides)))
    return out


def time_rung(cfg, args):
    """Builds one rung, runs it; returns its record (on every rank)."""
    seed_everything(cfg.RNG_SEED)
    parts = build_components(cfg, loaders=False)
    world = distributed.world_size()
    per_rank = cfg.TRAIN.BATCH_SIZE // world
    inputs, targets = timing.synthetic_batch(parts, per_rank, cfg.TRAIN.IM_SIZE)
    # The loss of the second step (after one update: the zero-initialized head makes
    # the first one log(classes)): the same weights and batch in every rung, so rungs
    # that change only the wrapper (DDP -> FSDP) must agree.
    train_step(parts, inputs, targets)
    loss, _, _ = train_step(parts, inputs, targets)
    second_loss = distributed.all_reduce_sum([float(loss.item())])[0] / world
    for _ in range(args.warmup):
        train_step(parts, inputs, targets)
    rounds = []
    for _ in range(args.rounds):
        timing.sync(parts.device)
        start = time.perf_counter()
        for _ in range(args.iters):
            train_step(parts, inputs, targets)
        timing.sync(parts.device)
        seconds = (time.perf_counter() - start) / args.iters
        rounds.append(distributed.all_reduce_max([seconds])[0])  # slowest rank
    step_s = statistics.median(rounds)
    flops = complexity(cfg)["flops"]
    batch = cfg.TRAIN.BATCH_SIZE
    record = {
        "im_size": cfg.TRAIN.IM_SIZE,
        "dtype": str(timing.compute_dtype(parts)).replace("torch.", ""),
        "step_s": step_s,
        "img_per_s": batch / step_s,
        "tflops_per_device": timing.train_flops(flops, batch) / step_s / world / 1e12,
        "epoch_hours": IMAGENET_TRAIN_IMAGES / (batch / step_s) / 3600,
        "second_loss": second_loss,
    }
    del parts, inputs, targets
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return record


def summarize(rows):
    """Ratios to the DDP baseline; the optimized rung of the epoch-time figure."""
    base = next((r for r in rows if r["name"] == "ddp"), rows[0])
    for r in rows:
        r["vs_baseline"] = r["tflops_per_device"] / base["tflops_per_device"]
        r["img_vs_baseline"] = r["img_per_s"] / base["img_per_s"]
    same_task = [r for r in rows if r["name"] not in OTHER_TASK]
    optimized = (same_task or rows)[-1]
    return {
        "baseline": base["name"],
        "optimized": optimized["name"],
        "optimized_vs_baseline": optimized["vs_baseline"],
        "epoch_hours_baseline": base["epoch_hours"],
        "epoch_hours_optimized": optimized["epoch_hours"],
    }


def print_table(record):
    print()
    print(
        f"{record['config']}: global batch {record['batch']} over "
        f"{record['devices']} x {record['device']}, torch {record['torch']}; fp32 "
        f"matmuls on CUDA: {record['fp32_math']}"
    )
    print("| rung | px | dtype | img/s | TFLOP/s per device | vs DDP | epoch (h) |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for r in record["rows"]:
        print(
            f"| {r['label']} | {r['im_size']} | {r['dtype']} | {r['img_per_s']:.1f} | "
            f"{r['tflops_per_device']:.4f} | {r['vs_baseline']:.2f}x | "
            f"{r['epoch_hours']:.2f} |"
        )
    hours = (record["epoch_hours_baseline"], record["epoch_hours_optimized"])
    print(
        f"  optimized ({record['optimized']}): {record['optimized_vs_baseline']:.2f}x "
        f"the DDP baseline; ImageNet-1k epoch {hours[0]:.2f} h -> {hours[1]:.2f} h"
    )


def _device_name(device):
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()})"


def main():
    args = _parser().parse_args()
    known = [n for n, _, _ in RUNGS]
    chosen = [s for s in args.steps.split(",") if s]
    unknown = [s for s in chosen if s not in known]
    if unknown:
        raise UserError(f"unknown rung {unknown[0]!r}; known: {', '.join(known)}")
    for key in ("rounds", "iters"):
        if getattr(args, key) < 1:
            raise UserError(f"--{key} must be >= 1")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rungs = [
        r
        for r in rung_configs(
            args.cfg_file, args.opts, args.batch, world, args.large_size
        )
        if r[0] in chosen
    ]
    if under_torchrun():
        init_process_group(rungs[0][2])
    elif any(cfg.FSDP.ENABLED for _, _, cfg in rungs):
        init_single_process_group(rungs[0][2])  # FSDP in one process needs a group
    apply_backend_flags(rungs[0][2])
    device = distributed.device()
    main_rank = distributed.is_main()
    rows = []
    for k, (name, label, cfg) in enumerate(rungs, start=1):
        if main_rank:
            print(f"rung {k}/{len(rungs)} {name}: building and timing", flush=True)
        row = {"name": name, "label": label, **time_rung(cfg, args)}
        rows.append(row)
        if main_rank:
            print(
                f"  {row['img_per_s']:.1f} img/s, {row['tflops_per_device']:.4f} "
                f"TFLOP/s per device",
                flush=True,
            )
    record = {
        "config": args.cfg_file,
        "batch": rungs[0][2].TRAIN.BATCH_SIZE,
        "devices": distributed.world_size(),
        "device": _device_name(device),
        "torch": torch.__version__,
        "fp32_math": fp32_math(),
        "rounds": args.rounds,
        "iters": args.iters,
        "rows": rows,
    }
    record.update(summarize(rows))
    if main_rank:
        print_table(record)
        if args.json_out:
            os.makedirs(os.path.dirname(os.path.abspath(args.json_out)), exist_ok=True)
            with open(args.json_out, "w") as f:
                json.dump(record, f, indent=1)
            print(f"  record: {args.json_out}")
        if args.plot_dir:
            for path in (
                plot_ladder(record, args.plot_dir),
                plot_epoch_time(record, args.plot_dir),
            ):
                print(f"  figure: {path}")
    if distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    run(main)
