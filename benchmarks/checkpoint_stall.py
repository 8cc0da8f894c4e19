"""Checkpoint stall, synchronous vs asynchronous, side by side in one run.

    python -m benchmarks.checkpoint_stall [--cfg configs/vit/ViT-L-16.yaml]
        [--layers 12] [--rounds 3] [--out-dir DIR] [--json-out FILE]

A model whose checkpoint (weights, AdamW moments, RNG and meter states) is a few GB
trains on synthetic batches with the real CheckpointManager; in each round it saves
once synchronously and once with TRAIN.CHECKPOINT_ASYNC (A, B, A, B, ...), timing:
- the stall: how long the checkpoint keeps the training loop, as the goodput account
  counts it (CheckpointManager's stall timer): synchronous, the whole write;
  asynchronous, the save call plus the wait of the next optimizer step for the copy
  to host memory (on a CPU the writer thread makes the copy beside that step's
  forward and backward);
- the step time without a write (the median of steps just before the save and just
  after the write) and while the asynchronous write is in flight (the writer thread
  shares the CPU cores, the memory bandwidth and the disk with training);
- the write's total time (asynchronous: from the save until the write completes);
- the training time the checkpoint costs: the stall plus, asynchronously, what the
  steps run beside the write lost (their number x the step time's growth).
Medians over the rounds; ratios async / sync. Checkpoints go to a temporary folder
(deleted after), CHECKPOINT_KEEP 1.
"""

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from contextlib import contextmanager

import torch

from pycls_fast.checkpoint import CheckpointManager
from pycls_fast.config import load_cfg
from pycls_fast.engine.timing import sync, synthetic_batch
from pycls_fast.engine.trainer import build_components, seed_everything, train_step
from pycls_fast.launch.cli import run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _state_gb(path: str) -> float:
    return os.path.getsize(path) / 1e9 if os.path.isfile(path) else float("nan")


def main():
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.checkpoint_stall",
        description=__doc__.split("\n\n")[0],
    )
    default_cfg = os.path.join(ROOT, "configs/vit/ViT-L-16.yaml")
    parser.add_argument("--cfg", default=default_cfg)
    parser.add_argument("--layers", type=int, default=12, help="VIT.NUM_LAYERS")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--out-dir", default="")
    parser.add_argument("--json-out", default="")
    args = parser.parse_args()
    out_dir = args.out_dir or tempfile.mkdtemp(prefix="ckpt_stall_")
    cfg = load_cfg(
        args.cfg,
        [
            "OUT_DIR", out_dir, "VIT.NUM_LAYERS", str(args.layers),
            "TRAIN.IM_SIZE", "32", "TEST.IM_SIZE", "32", "MODEL.NUM_CLASSES", "10",
            "TRAIN.BATCH_SIZE", str(args.batch), "OPTIM.OPTIMIZER", "adamw",
            "TRAIN.CHECKPOINT_KEEP", "1", "AMP.MODE", "fp32", "NUM_GPUS", "1",
            "TRAIN.MIXED_PRECISION", "False",
        ],
    )  # fmt: skip
    seed_everything(0)
    parts = build_components(cfg, loaders=())
    device = parts.device
    inputs, targets = synthetic_batch(parts, args.batch, cfg.TRAIN.IM_SIZE)

    def step() -> float:
        sync(device)
        start = time.perf_counter()
        train_step(parts, inputs, targets)
        sync(device)
        return time.perf_counter() - start

    for _ in range(2):  # warm-up; creates the AdamW state
        step()
    stalls = []

    @contextmanager
    def stall_timer():
        start = time.perf_counter()
        try:
            yield
        finally:
            stalls.append(time.perf_counter() - start)

    manager = CheckpointManager(parts, stall_timer=stall_timer)
    parts.before_update = manager.wait_staged  # as train_model sets it
    params = sum(p.numel() for p in parts.model.parameters())
    results = {"sync": [], "async": []}
    position = 0
    try:
        for _ in range(args.rounds):
            for mode in ("sync", "async"):
                quiet = [step() for _ in range(3)]
                manager.asynchronous = mode == "async"
                position += 1
                stalls.clear()
                start = time.perf_counter()
                manager.save(0, position)
                during = []
                if mode == "async":
                    while manager.pending is not None and not manager.pending.done():
                        during.append(step())
                    manager.finish_pending()
                write = time.perf_counter() - start
                stall = sum(stalls)
                # The steps right before and right after the write are the step
                # time without one (the machine drifts: both sides of it).
                quiet += [step() for _ in range(3)]
                slower = (
                    len(during) * (statistics.median(during) - statistics.median(quiet))
                    if during
                    else 0.0
                )
                results[mode].append(
                    {
                        "stall_s": stall,
                        # What the checkpoint costs training: its stall, plus what
                        # the steps beside the write lost to the writer thread.
                        "lost_s": stall + slower,
                        "write_s": write,
                        "step_s": statistics.median(quiet),
                        "step_during_write_s": (
                            statistics.median(during) if during else float("nan")
                        ),
                        "steps_during_write": len(during),
                    }
                )
        from pycls_fast.checkpoint.files import last_checkpoint

        size = _state_gb(last_checkpoint(out_dir))
    finally:
        if not args.out_dir:
            shutil.rmtree(out_dir, ignore_errors=True)

    def med(mode, key):
        values = [r[key] for r in results[mode] if r[key] == r[key]]
        return statistics.median(values) if values else float("nan")

    summary = {
        "checkpoint_gb": size,
        "params": params,
        "sync_stall_s": med("sync", "stall_s"),
        "async_stall_s": med("async", "stall_s"),
        "sync_lost_s": med("sync", "lost_s"),
        "async_lost_s": med("async", "lost_s"),
        "async_write_s": med("async", "write_s"),
        "step_s": med("async", "step_s"),
        "step_during_write_s": med("async", "step_during_write_s"),
        "rounds": args.rounds,
        "torch": torch.__version__,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
        f"{torch.get_num_threads()} torch threads, device {device}",
    }
    stalls = summary["async_stall_s"], summary["sync_stall_s"]
    summary["async_over_sync_stall"] = stalls[0] / stalls[1]
    summary["async_over_sync_lost"] = summary["async_lost_s"] / summary["sync_lost_s"]
    summary["step_slowdown_during_write"] = (
        summary["step_during_write_s"] / summary["step_s"]
    )
    print(
        f"{os.path.basename(args.cfg)} at {args.layers} blocks: {params:,} parameters, "
        f"checkpoint {size:.2f} GB; torch {torch.__version__}; {summary['machine']}"
    )
    print("| | sync | async | async / sync |\n|---|---:|---:|---:|")
    print(
        f"| training stall per checkpoint (s) | {summary['sync_stall_s']:.2f} | "
        f"{summary['async_stall_s']:.2f} | {summary['async_over_sync_stall']:.2f} |"
    )
    print(
        f"| training time lost per checkpoint (s): stall + slower steps beside the "
        f"write | {summary['sync_lost_s']:.2f} | {summary['async_lost_s']:.2f} | "
        f"{summary['async_over_sync_lost']:.2f} |"
    )
    print(
        f"| write until complete (s) | {med('sync', 'write_s'):.2f} | "
        f"{summary['async_write_s']:.2f} | |"
    )
    print(
        f"| step time (s): without a write / while the write runs | "
        f"{summary['step_s']:.3f} | {summary['step_during_write_s']:.3f} | "
        f"{summary['step_slowdown_during_write']:.2f} |"
    )
    print(json.dumps({**summary, "rounds_detail": results}))
    if args.json_out:
        os.makedirs(os.path.dirname(args.json_out) or ".", exist_ok=True)
        with open(args.json_out, "w") as f:
            json.dump({**summary, "rounds_detail": results}, f, indent=1)


if __name__ == "__main__":
    run(main)
