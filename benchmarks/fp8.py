"""Float8 training (AMP.FP8) against bf16 on one GPU: step speed, MFU and loss.

    python -m benchmarks.fp8 [--cfgs CFG ...] [--batch 64] [--rounds 3]
        [--iters 5] [--loss-steps 200] [--loss-cfgs CFG ...] [--out-dir out/bench/fp8]
        [KEY VALUE ...]

For each config (default configs/vit/ViT-L-16.yaml and ViT-H-14.yaml): bf16
(AMP.MODE O1), float8 'tensorwise' and float8 'rowwise', all with TRAIN.COMPILE
block, built side by side on the device. The training step on a synthetic batch
is timed interleaved (bf16, tensorwise, rowwise, bf16, ...; the medians of
per-round ratios to bf16), its MFU taken against the device's bf16 dense peak (as
torchtitan reports float8's). Then each variant trains `--loss-steps` steps from
the same initial weights on the same stream of synthetic batches that carry a
class signal (a fixed random pattern per class under noise), and the mean loss of
the last tenth of the steps is compared with bf16's (the goal: within 1%); the
models timed are reset to their initial weights for it, not built again
(`--loss-cfgs`: the configs whose curves are run, default all). Writes
fp8.json and the table fp8.md to --out-dir (benchmarks/gpu_node.sh runs it as its
fp8 step). `--emulate` runs torchao's fp32 emulation, for the CPU smoke test (no
speed-up to measure).
"""

import argparse
import json
import os
import platform
import statistics

import torch

from benchmarks.harness import interleave, per_round_ratios
from pycls_fast.config import load_cfg
from pycls_fast.engine.trainer import build_components, seed_everything, train_step
from pycls_fast.launch.cli import run
from pycls_fast.models import complexity
from pycls_fast.observe.throughput import Throughput, device_peak_flops
from pycls_fast.runtime import distributed

CFGS = ["configs/vit/ViT-L-16.yaml", "configs/vit/ViT-H-14.yaml"]
VARIANTS = {
    "bf16": ["AMP.FP8", "False"],
    "fp8_tensorwise": ["AMP.FP8", "True", "AMP.FP8_RECIPE", "tensorwise"],
    "fp8_rowwise": ["AMP.FP8", "True", "AMP.FP8_RECIPE", "rowwise"],
}


def class_batch(step: int, batch: int, cfg, device, dtype):
    """Synthetic images with a class signal: class c's fixed random pattern (seed
    c) plus unit noise (seed step), normalized-image scale. (B, 3, S, S) in `dtype`,
    labels (B,) int64; the same for every variant."""
    size, classes = cfg.TRAIN.IM_SIZE, cfg.MODEL.NUM_CLASSES
    g = torch.Generator().manual_seed(1000 + step)
    labels = torch.randint(0, classes, (batch,), generator=g)
    noise = torch.randn(batch, 3, size, size, generator=g)
    patterns = torch.stack(
        [
            torch.randn(3, size, size, generator=torch.Generator().manual_seed(int(c)))
            for c in labels
        ]
    )
    images = 0.5 * patterns + noise
    return images.to(device, dtype), labels.to(device)


def build(cfg_file: str, opts: list[str], variant: list[str], batch: int):
    cfg = load_cfg(
        cfg_file,
        [
            "NUM_GPUS", "1", "TRAIN.BATCH_SIZE", str(batch),
            "TEST.BATCH_SIZE", str(batch), "AMP.MODE", "O1", "AMP.DTYPE", "bf16",
            "TRAIN.COMPILE", "block", "DATA.PATH", "", *opts, *variant,
        ],
    )  # fmt: skip
    seed_everything(0)
    return cfg, build_components(cfg, loaders=False)


def bench_config(cfg_file, opts, args, device, losses=True):
    """{variant: {img_per_s, mfu, ratio[, loss_tail]}} for one config; the loss
    curves when `losses`."""
    built = {name: build(cfg_file, opts, v, args.batch) for name, v in VARIANTS.items()}
    # The initial weights, on the host: the loss curves start from them again
    # after the timed steps, without building (and compiling) the models twice.
    initial = {
        name: {k: v.detach().cpu().clone() for k, v in p.model.state_dict().items()}
        for name, (_, p) in built.items()
    }
    cfg = built["bf16"][0]
    dtype = torch.float32
    x, y = class_batch(0, args.batch, cfg, device, dtype)
    steps = {name: (lambda p=p: train_step(p, x, y)) for name, (_, p) in built.items()}
    times, _ = interleave(steps, device, args.rounds, args.iters, warmup=args.warmup)
    peak, _ = device_peak_flops(device, torch.bfloat16)
    flops = complexity(cfg)["flops"]
    per_round = args.iters
    out = {}
    for name in VARIANTS:
        median = statistics.median(times[name])
        img_per_s = args.batch / median
        rounds_t = [
            statistics.median(times[name][i : i + per_round])
            for i in range(0, len(times[name]), per_round)
        ]
        rounds_b = [
            statistics.median(times["bf16"][i : i + per_round])
            for i in range(0, len(times["bf16"]), per_round)
        ]
        speedup = statistics.median(per_round_ratios(rounds_b, rounds_t))
        mfu = Throughput(flops, 1, peak).fields(img_per_s)["mfu"]
        out[name] = {"img_per_s": img_per_s, "mfu": mfu, "speedup": speedup}
    steps.clear()
    if not losses:
        return out
    for name, (variant_cfg, parts) in built.items():
        # The loss curves: the same initial weights and batches for every variant,
        # a fresh optimizer state (the timed steps' is dropped).
        parts.model.load_state_dict(initial.pop(name))
        parts.optimizer.state.clear()
        curve = []
        for step in range(args.loss_steps):
            xs, ys = class_batch(step, args.batch, variant_cfg, device, dtype)
            loss, _, _ = train_step(parts, xs, ys)
            curve.append(loss.detach())
        curve = [float(v) for v in torch.stack(curve).cpu()]  # one host read
        tail = curve[-max(1, args.loss_steps // 10) :]
        out[name]["losses"] = curve
        out[name]["loss_tail"] = sum(tail) / len(tail)
    for name in VARIANTS:
        out[name]["loss_vs_bf16"] = out[name]["loss_tail"] / out["bf16"]["loss_tail"]
    return out


def table(results: dict, device_name: str) -> str:
    lines = [
        f"Float8 vs bf16 on {device_name} (torch {torch.__version__}), "
        "TRAIN.COMPILE block, AMP.MODE O1",
        "",
        "| model | variant | img/s | x bf16 | MFU (bf16 peak) | loss, last 10% "
        "| x bf16 |",
        "|---|---|---|---|---|---|---|",
    ]
    for cfg_file, rows in results.items():
        model = os.path.splitext(os.path.basename(cfg_file))[0]
        for name, r in rows.items():
            loss = (
                f"{r['loss_tail']:.4f} | {r['loss_vs_bf16']:.4f}"
                if "loss_tail" in r
                else "- | -"
            )
            lines.append(
                f"| {model} | {name} | {r['img_per_s']:.1f} | {r['speedup']:.3f} "
                f"| {r['mfu']:.3f} | {loss} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cfgs", nargs="+", default=CFGS)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--loss-steps", type=int, default=200)
    parser.add_argument(
        "--loss-cfgs", nargs="+", default=None, help="the loss curves of these only"
    )
    parser.add_argument("--out-dir", default="out/bench/fp8")
    parser.add_argument(
        "--emulate", action="store_true", help="torchao's fp32 emulation (CPU)"
    )
    parser.add_argument("opts", nargs=argparse.REMAINDER, help="KEY VALUE ...")
    args = parser.parse_args()
    opts = list(args.opts)
    if args.emulate:
        opts += ["AMP.FP8_EMULATE", "True", "TRAIN.COMPILE", "off"]
    device = distributed.device()
    loss_cfgs = args.cfgs if args.loss_cfgs is None else args.loss_cfgs
    results = {
        c: bench_config(c, opts, args, device, losses=c in loss_cfgs) for c in args.cfgs
    }
    name = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "CPU"
    )
    os.makedirs(args.out_dir, exist_ok=True)
    text = table(results, name)
    with open(os.path.join(args.out_dir, "fp8.md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out_dir, "fp8.json"), "w") as f:
        json.dump({"device": name, "torch": torch.__version__, **results}, f)
    print(text, end="")


if __name__ == "__main__":
    run(main)
