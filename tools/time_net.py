#!/usr/bin/env python3
"""Measures the training step and the loader; projects the ImageNet-1k epoch time.

    python tools/time_net.py --cfg FILE [--json] [--loader-batches N] [KEY VALUE ...]

Reports forward, forward+backward and full-step times on synthetic batches of
TRAIN.BATCH_SIZE / processes, evaluation throughput, the loader's images/s on
DATA.PATH (or, when DATA.PATH is empty, on a temporary folder of photo-like JPEGs of
ImageNet size), the model FLOP utilization (MFU) against the matmul peak of this device
and dtype measured in the same run, and the projected time of one ImageNet-1k epoch
(1,281,167 images) at the slower of the step and the loader. With --json the last line
is one JSON object of these figures.
"""

import json
import os
import platform
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from pycls_fast.core import benchmark, distributed  # noqa: E402
from pycls_fast.core.cli import UserError, cfg_from_args, config_parser, run  # noqa: E402
from pycls_fast.core.trainer import build_components, seed_everything  # noqa: E402
from pycls_fast.datasets.loader import construct_train_loader  # noqa: E402
from pycls_fast.models import complexity  # noqa: E402


def loader_throughput(cfg, batches):
    """The train loader's images/s on DATA.PATH, or on a temporary JPEG folder."""
    if cfg.DATA.PATH:
        return benchmark.time_loader(
            construct_train_loader(cfg), batches
        ), cfg.DATA.PATH
    from pycls_fast.datasets.synthetic import make_image_folder

    per_rank = cfg.TRAIN.BATCH_SIZE // distributed.world_size()
    images = per_rank * (batches + 2)
    with tempfile.TemporaryDirectory() as root:
        make_image_folder(root, splits=("train",), num_classes=4,
                          images_per_class=-(-images // 4))  # fmt: skip
        cfg.defrost()
        cfg.DATA.PATH, cfg.DATA.INDEX_CACHE = root, False
        rate = benchmark.time_loader(construct_train_loader(cfg), batches)
        cfg.DATA.PATH = ""
    return rate, "synthetic JPEGs (500x375)"


def main():
    parser = config_parser("Time the training step and the loader; project epoch time.")
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    parser.add_argument(
        "--loader-batches", type=int, default=8, help="batches to time the loader on"
    )
    parser.add_argument("--no-loader", action="store_true", help="skip the loader")
    args = parser.parse_args()
    cfg = cfg_from_args(args)
    if args.loader_batches < 1:
        raise UserError("--loader-batches must be >= 1")
    seed_everything(cfg.RNG_SEED)
    parts = build_components(cfg, loaders=False)
    world = distributed.world_size()
    batch = cfg.TRAIN.BATCH_SIZE // world
    warmup, iters = cfg.PREC_TIME.WARMUP_ITER, cfg.PREC_TIME.NUM_ITER
    train = benchmark.time_train(parts, batch, warmup, iters)
    test_batch = cfg.TEST.BATCH_SIZE // world
    test_s = benchmark.time_test(parts, test_batch, warmup, iters)
    loader_rate, loader_on = (None, None)
    if not args.no_loader:
        loader_rate, loader_on = loader_throughput(cfg, args.loader_batches)
    dtype = benchmark.compute_dtype(parts)
    peak = benchmark.matmul_peak_flops(parts.device, dtype)
    flops = complexity(cfg)["flops"]  # multiply-adds per image, forward
    train_rate = batch / train["step_s"] * world
    achieved = 3 * 2 * flops * batch / train["step_s"]  # forward + 2x backward, 2/MAC
    bottleneck = min(train_rate, loader_rate * world) if loader_rate else train_rate
    record = {
        "config": args.cfg_file,
        "device": str(parts.device),
        "precision": f"{parts.mode.value}/{str(parts.half).replace('torch.', '')}",
        "batch_per_process": batch,
        "processes": world,
        "fwd_ms": 1e3 * train["fwd_s"],
        "fwd_bwd_ms": 1e3 * train["fwd_bwd_s"],
        "step_ms": 1e3 * train["step_s"],
        "train_img_per_s": train_rate,
        "test_img_per_s": test_batch / test_s * world,
        "loader_img_per_s": loader_rate * world if loader_rate else None,
        "model_gflops_per_img": 2 * flops / 1e9,
        "achieved_tflops": achieved / 1e12,
        "matmul_peak_tflops": peak / 1e12,
        "mfu": achieved / peak,
        "epoch_time_s": benchmark.IMAGENET_TRAIN_IMAGES / bottleneck,
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
    }
    r = record
    print(
        f"{args.cfg_file} on {r['device']} ({r['precision']}), batch {batch} x {world}"
    )
    print(
        f"  forward {r['fwd_ms']:.1f} ms, forward+backward {r['fwd_bwd_ms']:.1f} ms, "
        f"full step {r['step_ms']:.1f} ms"
    )
    print(f"  train {train_rate:.1f} img/s, test {record['test_img_per_s']:.1f} img/s")
    if loader_rate:
        print(f"  loader {record['loader_img_per_s']:.1f} img/s on {loader_on}")
    print(
        f"  {r['achieved_tflops']:.3f} TFLOP/s of a measured "
        f"{r['matmul_peak_tflops']:.3f} TFLOP/s {dtype} matmul peak: "
        f"MFU {100 * r['mfu']:.1f}%"
    )
    hours = record["epoch_time_s"] / 3600
    print(f"  projected ImageNet-1k epoch: {hours:.2f} h")
    if args.json:
        print(json.dumps(record))


if __name__ == "__main__":
    run(main)
