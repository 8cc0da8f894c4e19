"""Optimizer step time for a model's parameter set: multi-tensor apply vs a loop.

    python -m benchmarks.optimizer [--cfg configs/vit/ViT-B-16.yaml] [--reps 7]

For each optimizer (sgd, adamw by default) times `optimizer.step()` over the model's
real parameter set (pycls weight-decay groups) with the per-parameter loop
(foreach=False, OPTIM.MTA False), torch's multi-tensor `foreach` implementation, and
the `fused` kernel where the device has one. Variants run interleaved (loop, foreach,
fused, loop, ...) and the medians are reported with the ratio to the loop.
"""

import argparse
import os
import platform
import statistics
import time

import torch

from pycls_fast.components.optimizer import param_groups
from pycls_fast.config import load_cfg
from pycls_fast.launch.cli import run
from pycls_fast.models import build_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = {
    "loop": {"foreach": False},
    "foreach": {"foreach": True},
    "fused": {"fused": True},
}


def make_optimizer(name, groups, flags):
    if name == "sgd":
        return torch.optim.SGD(groups, lr=0.1, momentum=0.9, nesterov=True, **flags)
    return torch.optim.AdamW(groups, lr=1e-3, **flags)


def bench(model, cfg, name, reps, device):
    """Returns {variant: median seconds per step}."""
    optimizers = {}
    for variant, flags in VARIANTS.items():
        clone = [p.detach().clone().requires_grad_() for p in model.parameters()]
        for p in clone:
            p.grad = torch.randn_like(p) * 1e-3
        by_id = dict(zip([id(p) for p in model.parameters()], clone))
        groups = [
            {**g, "params": [by_id[id(p)] for p in g["params"]]}
            for g in param_groups(model, cfg)
        ]
        try:
            opt = make_optimizer(name, groups, flags)
            opt.step()  # warm-up; creates the optimizer state
        except (RuntimeError, ValueError):
            continue  # no fused kernel for this device / dtype
        optimizers[variant] = opt
    times = {v: [] for v in optimizers}
    for _ in range(reps):
        for variant, opt in optimizers.items():
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            opt.step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[variant].append(time.perf_counter() - start)
    return {v: statistics.median(t) for v, t in times.items()}


def main():
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.optimizer", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--cfg", default=os.path.join(ROOT, "configs/vit/ViT-B-16.yaml")
    )
    parser.add_argument("--optimizers", default="sgd,adamw")
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    cfg = load_cfg(args.cfg)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build_model(cfg).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    n_tensors = len(list(model.parameters()))
    print(
        f"{os.path.basename(args.cfg)}: {n_params:,} parameters, {n_tensors} tensors; "
        f"torch {torch.__version__}, {platform.machine()}, {torch.get_num_threads()} "
        f"threads, device {device}"
    )
    print("| optimizer | variant | step ms | vs loop |\n|---|---|---:|---:|")
    for name in args.optimizers.split(","):
        res = bench(model, cfg, name, args.reps, device)
        for variant, seconds in res.items():
            ratio = res["loop"] / seconds
            print(f"| {name} | {variant} | {1e3 * seconds:.1f} | {ratio:.2f}x |")


if __name__ == "__main__":
    run(main)
