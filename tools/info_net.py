#!/usr/bin/env python3
"""Prints a model and its complexity: python tools/info_net.py --cfg FILE [--json]."""

import json
import os

from pycls_fast.core.cli import cfg_from_args, config_parser, run
from pycls_fast.models import build_model, complexity


def main():
    parser = config_parser("Print a model and its complexity (params, flops, acts).")
    parser.add_argument(
        "--json", action="store_true", help="end with one JSON line of the figures"
    )
    parser.add_argument(
        "--summary", action="store_true", help="one line per config, no module tree"
    )
    args = parser.parse_args()
    cfg = cfg_from_args(args)
    cx = complexity(cfg)
    name = os.path.splitext(os.path.basename(args.cfg_file))[0]
    line = (
        f"{name}: params {cx['params']:,}  flops {cx['flops']:,} "
        f"({cx['flops'] / 1e9:.2f} GF)  acts {cx['acts']:,} ({cx['acts'] / 1e6:.2f} M)"
        f"  @ {cfg.TRAIN.IM_SIZE}px, {cfg.VIT.CLASSIFIER_TYPE}, {cfg.VIT.LAYOUT}"
    )
    if not args.summary:
        print(build_model(cfg))
    print(line)
    if args.json:
        record = {"config": args.cfg_file, "im_size": cfg.TRAIN.IM_SIZE, **cx}
        print(json.dumps(record))


if __name__ == "__main__":
    run(main)
