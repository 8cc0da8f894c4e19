"""Progressive resolution (TRAIN.SIZE_SCHEDULE) against a fixed size: the training
step's time per image at each stage's size, side by side, and the projected time of
the whole schedule.

    python -m benchmarks.progressive [--cfg configs/vit/ViT-S-16.yaml]
        [--schedule "[[0, 128, 1024], [100, 160, 1024], [200, 192, 1024], ...]"]
        [--epochs 300] [--batch 16] [--rounds 3] [--json-out FILE]

One model, built at the config's TRAIN.IM_SIZE (the schedule's last size), takes
training steps (forward, backward, optimizer) on synthetic batches of `--batch`
images at every stage's size, interleaved (stage 1, stage 2, ..., fixed, stage 1,
...); the medians give seconds per image. An ImageNet-1k epoch (1,281,167 images) at
each stage, and the whole schedule over `--epochs` epochs, are projected from them and
compared with every epoch at the fixed size. The step batch is the same for every
size, so the ratios show the cost of the image size alone (a stage's larger batch
only adds its own efficiency on a GPU). Prints a table; with --json-out, one JSON
object.
"""

import argparse
import ast
import json
import platform
import statistics

import torch

from benchmarks.harness import interleave
from pycls_fast.config import load_cfg
from pycls_fast.engine import timing
from pycls_fast.engine.trainer import build_components, seed_everything, train_step
from pycls_fast.launch.cli import run

IMAGENET_TRAIN = 1_281_167
DEFAULT_SCHEDULE = (
    "[[0, 128, 1024], [100, 160, 1024], [200, 192, 1024], [250, 224, 1024]]"
)


def stage_epochs(schedule, epochs):
    """[(size, number of epochs)] of each stage over `epochs` epochs."""
    starts = [s[0] for s in schedule] + [epochs]
    return [(s[1], starts[i + 1] - s[0]) for i, s in enumerate(schedule)]


def bench(cfg, schedule, epochs, batch, rounds):
    """Returns the report: seconds per image per size, projected epoch times."""
    seed_everything(0)
    parts = build_components(cfg, loaders=False)
    sizes = sorted({s[1] for s in schedule} | {cfg.TRAIN.IM_SIZE})
    batches = {s: timing.synthetic_batch(parts, batch, s) for s in sizes}

    def step(size):
        return lambda: train_step(parts, *batches[size])

    times, _ = interleave(
        {f"{s} px": step(s) for s in sizes}, parts.device, rounds=rounds, iters=1
    )
    per_image = {s: statistics.median(times[f"{s} px"]) / batch for s in sizes}
    fixed = cfg.TRAIN.IM_SIZE
    stages = [
        {
            "size": size,
            "epochs": n,
            "s_per_image": per_image[size],
            "epoch_h": per_image[size] * IMAGENET_TRAIN / 3600,
            "vs_fixed": per_image[size] / per_image[fixed],
        }
        for size, n in stage_epochs(schedule, epochs)
    ]
    total = sum(s["epoch_h"] * s["epochs"] for s in stages)
    fixed_total = per_image[fixed] * IMAGENET_TRAIN / 3600 * epochs
    return {
        "model": cfg.DESC or "ViT",
        "schedule": schedule,
        "epochs": epochs,
        "step_batch": batch,
        "stages": stages,
        "schedule_h": total,
        "fixed_h": fixed_total,
        "fixed_size": fixed,
        "speedup": fixed_total / total,
        "device": str(parts.device),
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cfg", default="configs/vit/ViT-S-16.yaml")
    parser.add_argument("--schedule", default=DEFAULT_SCHEDULE)
    parser.add_argument("--epochs", type=int, default=300)
    parser.add_argument("--batch", type=int, default=16, help="images per timed step")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--json-out", default="")
    parser.add_argument("opts", nargs="*", help="KEY VALUE config overrides")
    args = parser.parse_args()
    schedule = ast.literal_eval(args.schedule)
    cfg = load_cfg(
        args.cfg,
        [*args.opts, "TRAIN.SIZE_SCHEDULE", str(schedule), "OPTIM.MAX_EPOCH",
         str(args.epochs), "NUM_GPUS", "1", "FSDP.ENABLED", "False"],
    )  # fmt: skip
    print(
        f"timing {len(schedule)} stages and {cfg.TRAIN.IM_SIZE} px, {args.rounds} "
        f"interleaved rounds of one {args.batch}-image step each (a minute or so on "
        "2 cores for ViT-S)",
        flush=True,
    )
    report = bench(cfg, schedule, args.epochs, args.batch, args.rounds)
    print(f"{'size':>6} {'epochs':>7} {'ms/img':>8} {'epoch h':>8} {'vs fixed':>9}")
    for s in report["stages"]:
        print(
            f"{s['size']:>6} {s['epochs']:>7} {1e3 * s['s_per_image']:>8.2f} "
            f"{s['epoch_h']:>8.2f} {s['vs_fixed']:>9.2f}"
        )
    print(
        f"schedule {report['schedule_h']:.1f} h vs fixed {report['fixed_size']} px "
        f"{report['fixed_h']:.1f} h: {report['speedup']:.2f}x "
        f"({report['device']}, {report['cpu']}, {report['threads']} threads, "
        f"torch {report['torch']})"
    )
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f)
    print(json.dumps(report))


if __name__ == "__main__":
    run(main)
