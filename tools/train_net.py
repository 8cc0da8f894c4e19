#!/usr/bin/env python3
"""Trains a model: python tools/train_net.py --cfg FILE [KEY VALUE ...]

One process by default; `NUM_GPUS N` spawns N local processes (one per GPU, or sharing
the CPU cores); under `torchrun --nproc_per_node N` each process is one rank;
`LAUNCH.MODE slurm` (or `submitit_local`) submits the job through submitit and returns
at once (`LAUNCH.WAIT True`: waits and reports its result)."""

import logging
import os

from pycls_fast.checkpoint.run_record import check_rerun
from pycls_fast.checkpoint.weights import check_weights
from pycls_fast.components.float8 import check_fp8_launch
from pycls_fast.config import check_launch
from pycls_fast.datasets.images.transforms import build_transform
from pycls_fast.datasets.loader import check_data
from pycls_fast.datasets.to_device.transform import DeviceBatchTransform
from pycls_fast.engine.trainer import train_model
from pycls_fast.errors import Stopped
from pycls_fast.launch.cli import cfg_from_args, config_parser, run
from pycls_fast.launch.submit import submit_or_launch
from pycls_fast.observe.logging import FILE_ONLY


def train(cfg):
    """Trains on this rank; a failure is also written to OUT_DIR/stdout.log."""
    try:
        return train_model(cfg)
    except Stopped:
        raise  # logged by the trainer: a requested stop, not a failure
    except Exception as e:
        if logging.getLogger().handlers:  # the reason in OUT_DIR/stdout.log too
            # Only there: stderr has its line (once, also when every rank fails).
            logging.getLogger("pycls_fast").error(
                "training stopped: %s", e, extra={FILE_ONLY: True}
            )
        raise


def main():
    parser = config_parser("Train a model (logs, checkpoints and plots in OUT_DIR).")
    cfg = cfg_from_args(parser.parse_args())
    check_launch(cfg)  # what to run is refused before what to read
    check_fp8_launch(cfg)
    # TRAIN.AUGMENT checked before OUT_DIR exists, on the host and on the device.
    build_transform(cfg, train=True)
    build_transform(cfg, train=False)  # TEST.IM_SIZE against the crop
    DeviceBatchTransform(cfg, "cpu")
    check_data(cfg, ("train", "test"))  # once, before any rank starts
    check_weights(cfg, train=True)  # TRAIN.WEIGHTS too
    check_rerun(cfg)  # a rerun into OUT_DIR keeps what its checkpoints mean
    results = submit_or_launch(train, cfg)
    if results is None:  # not rank 0
        return
    test = results.get("test", {})
    if test:
        print(f"final top-1 accuracy: {100.0 - test['top1_err']:.2f}%", flush=True)
    print(f"logs: {os.path.join(cfg.OUT_DIR, 'stdout.log')}")


if __name__ == "__main__":
    run(main)
