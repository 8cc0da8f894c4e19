#!/usr/bin/env python3
"""Plans a run's layout: python tools/plan_net.py --cfg FILE --gpus 8,64 --gpu-gib 80

Prints, for the (pipeline x data x tensor)-parallel layouts of that many GPUs, with
DDP or FSDP over the data-parallel ranks and with or without activation
checkpointing, the predicted memory per rank (parameters, gradients, optimizer
state, master weights, EMA, gathered weights, activations) and step speed of
training the config, and the fastest layout that fits (pycls_fast/parallel/planner.py;
PARALLEL.AUTO makes train_net use it). TRAIN.BATCH_SIZE is the global batch, as in
training. --all lists every candidate.

--dry-run answers "will this job start, and fit?" for the config's own layout
(NUM_GPUS, PARALLEL.*, FSDP.*): this process plays one rank (--rank) of the job
with a fake process group and fake tensors and runs the real construction,
parallelization, optimizer, two training steps and the checkpoint's save plan,
then prints that rank's memory next to the planner's (pycls_fast/engine/dry_run.py).
"""

import argparse
import os

from pycls_fast.config import load_cfg
from pycls_fast.errors import UserError
from pycls_fast.launch.cli import ArgumentParser, run
from pycls_fast.parallel.planner import format_plan, plan


def main():
    parser = ArgumentParser(description=__doc__.split("\n")[0], overrides=True)
    parser.add_argument("--cfg", dest="cfg_file", required=True, action="append")
    parser.add_argument(
        "--gpus", default="8", help="GPU counts, comma separated (8,64,512)"
    )
    parser.add_argument("--gpu-gib", type=float, default=80.0)
    parser.add_argument("--all", action="store_true", help="every candidate layout")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="run one rank of the config's NUM_GPUS-rank job with fake tensors",
    )
    parser.add_argument("--rank", type=int, default=0, help="the rank --dry-run plays")
    parser.add_argument(
        "--peak-ops",
        action="store_true",
        help="with --dry-run: the bytes at the step's peak by the op that made them",
    )
    parser.add_argument("opts", nargs=argparse.REMAINDER, help="KEY VALUE overrides")
    args = parser.parse_args()
    try:
        args.gpus = [int(g) for g in args.gpus.split(",")]
    except ValueError:
        raise UserError(f"--gpus: comma-separated integers, got {args.gpus}") from None
    if args.peak_ops and not args.dry_run:
        raise UserError(
            "--peak-ops: only with --dry-run (it reports the dry run's peak)"
        )
    if any(g <= 0 for g in args.gpus) or args.gpu_gib <= 0:
        raise UserError("--gpus and --gpu-gib must be positive")
    for path in args.cfg_file:
        cfg = load_cfg(path, args.opts or [])
        name = os.path.splitext(os.path.basename(path))[0]
        if args.dry_run:
            from pycls_fast.engine.dry_run import dry_run, format_report

            report = dry_run(cfg, args.rank, by_op=args.peak_ops)
            print(format_report(name, args.gpu_gib, report))
            continue
        for gpus in args.gpus:
            if gpus > cfg.TRAIN.BATCH_SIZE:
                raise UserError(
                    f"TRAIN.BATCH_SIZE ({cfg.TRAIN.BATCH_SIZE}) is smaller than "
                    f"--gpus {gpus}: give a global batch of at least one image per GPU"
                )
            best, rows = plan(cfg, gpus, args.gpu_gib)
            show = 0 if args.all else 8
            print(format_plan(name, gpus, args.gpu_gib, best, rows, show))


if __name__ == "__main__":
    run(main)
