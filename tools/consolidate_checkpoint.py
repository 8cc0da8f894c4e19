#!/usr/bin/env python3
"""Writes one file from a sharded (FSDP) checkpoint, for sharing and for tools.

    python tools/consolidate_checkpoint.py OUT_DIR/checkpoints/model_epoch_0100.dcp \\
        model_epoch_0100.pyth

The output holds the full model weights (and the EMA weights when the run kept them)
as `model_state` / `ema_state`, plus the epoch and config: TEST.WEIGHTS,
TRAIN.WEIGHTS and tools/convert_weights.py read it. Runs in one process; the
optimizer state stays in the sharded checkpoint (resuming reads that directly, at any
world size).
"""

import os

from pycls_fast.checkpoint import sharded
from pycls_fast.errors import UserError
from pycls_fast.launch.cli import ArgumentParser, run


def main():
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", help="sharded checkpoint directory (*.dcp)")
    parser.add_argument("dst", help="single checkpoint file to write (*.pyth)")
    args = parser.parse_args()
    if not sharded.is_sharded(args.src):
        raise UserError(f"{args.src} is not a sharded checkpoint directory")
    if os.path.isdir(args.dst):
        raise UserError(f"{args.dst} is a directory: name the file to write")
    meta = sharded.consolidate(args.src, args.dst)
    print(
        f"wrote {args.dst} (epoch {meta.get('epoch')}, iteration {meta.get('iter')}, "
        f"written by {meta.get('world_size')} processes)"
    )


if __name__ == "__main__":
    run(main)
