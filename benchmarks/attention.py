"""Measures the attention kernels, forward and forward+backward, per dtype.

    python -m benchmarks.attention [--shapes vit-s,vit-b] [--batch 32] [--reps 7]

Kernels: every name in pycls_fast.models.attention.KERNELS that runs on this device.
Runs are interleaved (k1, k2, ..., k1, k2, ...) and the median is reported, with the
ratio to the explicit matmul-softmax-matmul form measured in the same run. The fastest
forward+backward kernel per dtype is what `VIT.ATTENTION: auto` should pick
(`MEASURED_BEST` in pycls_fast/models/attention.py).
"""

import argparse
import json
import platform
import statistics
import sys
import time

import torch

from pycls_fast.errors import UserError
from pycls_fast.launch.cli import run
from pycls_fast.models.attention import KERNELS, attend

# name: (heads, seq, head_dim) of ViT attention at 224 px with 16 px patches
SHAPES = {
    "vit-s": (6, 197, 64),
    "vit-p4gf-pooled": (6, 196, 64),
    "vit-b": (12, 197, 64),
    "vit-l": (16, 197, 64),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _inputs(batch, heads, seq, head_d, dtype, device, grad):
    """q, k, v as the model makes them: strided views of one fused projection."""
    g = torch.Generator(device="cpu").manual_seed(0)
    qkv = torch.randn(batch, seq, 3, heads, head_d, generator=g)
    qkv = qkv.to(device=device, dtype=dtype).requires_grad_(grad)
    return qkv


def _step(kernel, qkv, backward, autocast):
    with torch.autocast(qkv.device.type, dtype=qkv.dtype, enabled=autocast):
        out = attend(*qkv.permute(2, 0, 3, 1, 4).unbind(0), kernel)
    if backward:
        out.backward(torch.ones_like(out))
        qkv.grad = None


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _time(kernel, qkv, backward, autocast, iters):
    _sync(qkv.device)
    start = time.perf_counter()
    for _ in range(iters):
        _step(kernel, qkv, backward, autocast)
    _sync(qkv.device)
    return (time.perf_counter() - start) / iters


def _usable(kernel, qkv, backward, autocast):
    try:
        _step(kernel, qkv, backward, autocast)
        return True
    except RuntimeError:
        return False  # the backend does not support this device / dtype / shape


def bench(shape, dtype_name, batch, reps, iters, device):
    """Returns {kernel: {"fwd_ms", "fwdbwd_ms"}} medians for one shape and dtype.

    A dtype name ending in '-autocast' runs the kernels under autocast (AMP O1), the
    others on tensors of that dtype (fp32, or O2/O3 half-precision models).
    """
    heads, seq, head_d = SHAPES[shape]
    autocast = dtype_name.endswith("-autocast")
    dtype = DTYPES[dtype_name.removesuffix("-autocast")]
    results = {}
    for backward, key in ((False, "fwd_ms"), (True, "fwdbwd_ms")):
        qkv = _inputs(batch, heads, seq, head_d, dtype, device, backward)
        kernels = [k for k in KERNELS if _usable(k, qkv, backward, autocast)]
        times = {k: [] for k in kernels}
        for k in kernels:
            _time(k, qkv, backward, autocast, 1)  # warm-up
        for _ in range(reps):
            for k in kernels:
                times[k].append(_time(k, qkv, backward, autocast, iters))
        for k in kernels:
            results.setdefault(k, {})[key] = statistics.median(times[k]) * 1e3
    return results


def main():
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.attention", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--shapes", default="vit-s,vit-b", help=",".join(SHAPES))
    parser.add_argument(
        "--dtypes",
        default="fp32,bf16,bf16-autocast",
        help="comma-separated: fp32, bf16, fp16, each optionally with -autocast",
    )
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--reps", type=int, default=7, help="interleaved repetitions")
    parser.add_argument("--iters", type=int, default=3, help="calls per timing")
    parser.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu"
    )
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    args = parser.parse_args()
    device = torch.device(args.device)
    shapes, dtypes = args.shapes.split(","), args.dtypes.split(",")
    for name in shapes:
        if name not in SHAPES:
            raise UserError(
                f"--shapes: unknown shape {name!r}; choose from {list(SHAPES)}"
            )
    for name in dtypes:
        if name.removesuffix("-autocast") not in DTYPES:
            raise UserError(
                f"--dtypes: unknown dtype {name!r}; choose from {list(DTYPES)}"
            )

    print(
        f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} threads, device {device}, batch {args.batch}"
    )
    record = {}
    best = {}
    cells = [(shape, dname) for shape in shapes for dname in dtypes]
    # A line per cell with the time left, from the cells done: a run takes
    # minutes on a CPU.
    start = time.monotonic()
    for done, (shape, dname) in enumerate(cells):
        left = (time.monotonic() - start) / done * (len(cells) - done) if done else 0
        eta = f", ~{left:.0f} s left" if done else ", timing the first"
        print(f"[{done + 1}/{len(cells)}] {shape} {dname}{eta}", file=sys.stderr)
        res = bench(shape, dname, args.batch, args.reps, args.iters, device)
        record[f"{shape}/{dname}"] = res
        ref = res["explicit"]
        print(f"\n{shape} (heads, seq, head_dim) = {SHAPES[shape]}, {dname}")
        print("| kernel | fwd ms | fwd+bwd ms | fwd+bwd vs explicit |")
        print("|---|---:|---:|---:|")
        for k, r in sorted(res.items(), key=lambda kv: kv[1]["fwdbwd_ms"]):
            ratio = ref["fwdbwd_ms"] / r["fwdbwd_ms"]
            print(f"| {k} | {r['fwd_ms']:.2f} | {r['fwdbwd_ms']:.2f} | {ratio:.2f}x |")
        fastest = min(res, key=lambda k: res[k]["fwdbwd_ms"])
        best.setdefault(dname, []).append(fastest)
    print("\nfastest forward+backward per dtype (one per shape):")
    for dname, names in best.items():
        print(f"  {device.type}/{dname}: {', '.join(names)}")
    if args.json:
        print(
            json.dumps({"device": device.type, "batch": args.batch, "results": record})
        )


if __name__ == "__main__":
    run(main)
