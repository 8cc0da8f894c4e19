#!/usr/bin/env python3
"""Averages checkpoints of a run into one checkpoint file.

    python tools/avg_checkpoints.py --run OUT_DIR --last 5 [--dst FILE]
    python tools/avg_checkpoints.py --run OUT_DIR --best 5 [--dst FILE]
    python tools/avg_checkpoints.py --checkpoints A.pyth B.dcp ... --dst FILE

--last K: the K newest complete checkpoints; --best K: the K end-of-epoch checkpoints
of lowest test top-1 error in the run's stdout.log. Single files and sharded (FSDP)
directories mix. The weights (and the EMA weights when every checkpoint has them) are
averaged in float64 and stored in their own dtype; epoch and config are the newest's.
The default --dst is OUT_DIR/avg_last<K>.pyth (avg_best<K>.pyth). Evaluate it like
any checkpoint:

    python tools/test_net.py --run OUT_DIR TEST.WEIGHTS OUT_DIR/avg_last5.pyth
"""

import os

from pycls_fast.checkpoint.averaging import (
    average_checkpoints,
    best_checkpoints,
    last_checkpoints,
)
from pycls_fast.errors import UserError
from pycls_fast.launch.cli import ArgumentParser, run


def _parser():
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--run", metavar="OUT_DIR", help="a train_net.py OUT_DIR")
    source.add_argument(
        "--checkpoints", nargs="+", metavar="CKPT", help="checkpoints to average"
    )
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--last", type=int, metavar="K", help="the K newest")
    which.add_argument("--best", type=int, metavar="K", help="the K of lowest error")
    parser.add_argument("--dst", help="checkpoint file to write (*.pyth)")
    return parser


def _choose(args):
    """(checkpoints to average, where to write them)."""
    if args.checkpoints:
        if args.last is not None or args.best is not None:
            raise UserError("--last / --best choose among --run's checkpoints")
        if not args.dst:
            raise UserError("--checkpoints needs --dst FILE")
        missing = [p for p in args.checkpoints if not os.path.exists(p)]
        if missing:
            raise UserError(f"--checkpoints: not found: {missing[0]}")
        return args.checkpoints, args.dst
    if not os.path.isdir(args.run):
        raise UserError(f"--run: folder not found: {args.run}")
    k = args.last or args.best
    if not k or k < 1:
        raise UserError("--run needs --last K or --best K (K >= 1)")
    if args.last:
        paths, name = last_checkpoints(args.run, k), f"avg_last{k}.pyth"
    else:
        paths, name = best_checkpoints(args.run, k), f"avg_best{k}.pyth"
    return paths, args.dst or os.path.join(args.run, name)


def main():
    args = _parser().parse_args()
    paths, dst = _choose(args)
    if os.path.isdir(dst) or dst.endswith(os.sep):
        raise UserError(f"--dst {dst} is a directory: name the file to write")
    if any(os.path.abspath(p) == os.path.abspath(dst) for p in paths):
        raise UserError(f"--dst {dst} is one of the checkpoints averaged")
    meta = average_checkpoints(paths, dst)
    names = ", ".join(meta["averaged"])
    print(f"wrote {dst}: the mean of {len(paths)} checkpoints ({names})")


if __name__ == "__main__":
    run(main)
