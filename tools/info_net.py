#!/usr/bin/env python3
"""Prints a model and its complexity: python tools/info_net.py --cfg FILE [--json].

    python tools/info_net.py --cfg A.yaml [--cfg B.yaml ...] [--summary | --json]
        [KEY VALUE ...]
    python tools/info_net.py --run OUT_DIR     # the model of a run (its config.yaml)

Per config: the module tree (unless --summary) and one line of params, flops and
activations. With --json only JSON is printed, one object per config and line
(`config`, `im_size`, `params`, `flops`, `acts`), so that it pipes into jq.
KEY VALUE overrides apply to every config."""

import json
import os

import torch

from pycls_fast.config import load_cfg
from pycls_fast.launch.cli import (
    cfg_file_and_opts,
    config_parser,
    require_config,
    run,
    run_config_file,
)
from pycls_fast.models import build_model, complexity


def summary_line(name: str, cfg, cx: dict) -> str:
    """One human line of a config's complexity."""
    return (
        f"{name}: params {cx['params']:,}  flops {cx['flops']:,} "
        f"({cx['flops'] / 1e9:.2f} GF)  acts {cx['acts']:,} ({cx['acts'] / 1e6:.2f} M)"
        f"  @ {cfg.TRAIN.IM_SIZE}px, {cfg.VIT.CLASSIFIER_TYPE}, {cfg.VIT.LAYOUT}"
    )


def main():
    parser = config_parser(
        "Print a model and its complexity (params, flops, acts).",
        several=True,
        run=True,
    )
    parser.add_argument(
        "--json", action="store_true", help="only JSON: one object per config and line"
    )
    parser.add_argument(
        "--summary", action="store_true", help="one line per config, no module tree"
    )
    args = parser.parse_args()
    require_config(args)
    paths = list(args.cfg_file or [])
    if args.run:
        paths.append(run_config_file(args.run))
    # Every config is checked before anything is printed.
    cfgs = [
        (path, load_cfg(*cfg_file_and_opts(path, args.opts or []))) for path in paths
    ]
    for path, cfg in cfgs:
        cx = complexity(cfg)
        if args.json:
            record = {"config": path, "im_size": cfg.TRAIN.IM_SIZE, **cx}
            print(json.dumps(record))
            continue
        if not args.summary:
            # On the meta device: the module tree without allocating the weights
            # (a ViT-22B would need 87 GB).
            with torch.device("meta"):
                print(build_model(cfg))
        print(summary_line(os.path.splitext(os.path.basename(path))[0], cfg, cx))


if __name__ == "__main__":
    run(main)
