#!/usr/bin/env python3
"""Trains a model: python tools/train_net.py --cfg FILE [KEY VALUE ...]."""

import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pycls_fast.core.cli import UserError, cfg_from_args, config_parser, run  # noqa: E402
from pycls_fast.core.trainer import train_model  # noqa: E402


def main():
    parser = config_parser("Train a model (logs, checkpoints and plots in OUT_DIR).")
    cfg = cfg_from_args(parser.parse_args())
    if cfg.NUM_GPUS > 1 and int(os.environ.get("WORLD_SIZE", 1)) == 1:
        raise UserError(
            f"NUM_GPUS is {cfg.NUM_GPUS}: multi-process training is not supported yet; "
            "set NUM_GPUS 1"
        )
    try:
        results = train_model(cfg)
    except Exception as e:
        if logging.getLogger().handlers:  # keep the reason in OUT_DIR/stdout.log too
            logging.getLogger("pycls_fast").error("training stopped: %s", e)
        raise
    test = results.get("test", {})
    if test:
        print(f"final top-1 accuracy: {100.0 - test['top1_err']:.2f}%", flush=True)
    print(f"logs: {os.path.join(cfg.OUT_DIR, 'stdout.log')}")


if __name__ == "__main__":
    run(main)
