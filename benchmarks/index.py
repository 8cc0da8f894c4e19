"""File-index benchmark at ImageNet scale: build time, added peak memory, first step.

    python -m benchmarks.index                        # `make bench-index`: 1000 x 1281
    python -m benchmarks.index --classes 100 --per-class 500 --json out.json

Generates (once, reused) an ImageNet-shaped tree of `--classes` class folders with
`--per-class` train images and 50 val images each. Every image is a hard link to one
small JPEG per class, so the tree holds 1.28M directory entries but 1000 files' bytes,
and the loader can decode it. Then, each in a fresh child process (imports done before
the measurement starts):
- cold: `construct_train_loader` with no index cache (scan of every class folder), and
  the first epoch's batch plan (the permutation and sharding), with DATA.INDEX_CACHE
  writing the cache;
- cached: the same with the cache written by `cold`;
- added peak memory: the process's peak resident set size (VmHWM, reset through
  /proc/self/clear_refs before the measurement) minus its resident size before it;
- first step: `tools/train_net.py` on the tree (a tiny ViT, one process), from the
  command's start to its first training log line (cold index, then cached).
The 14M projection scales the added memory by image count (the index is linear in N);
the epoch plans (a folder's permutation, the shards' order) are measured at 14.2M
images directly, for rank 0 of 8.
"""

import argparse
import io
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TINY = [
    "TRAIN.IM_SIZE", "32", "TEST.IM_SIZE", "32", "VIT.PATCH_SIZE", "8",
    "VIT.HIDDEN_DIM", "48", "VIT.NUM_HEADS", "4", "VIT.MLP_DIM", "96",
    "VIT.NUM_LAYERS", "2", "MODEL.NUM_CLASSES", "1000", "TRAIN.BATCH_SIZE", "32",
    "TEST.BATCH_SIZE", "32", "OPTIM.MAX_EPOCH", "1", "LOG_PERIOD", "1",
    "DATA_LOADER.NUM_WORKERS", "2", "NUM_GPUS", "1",
]  # fmt: skip

VAL_PER_CLASS = 50


def _parser():
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.index", description=__doc__.split("\n")[0]
    )
    p.add_argument("--root", default="/tmp/pycls_fast_bench/index_tree")
    p.add_argument("--classes", type=int, default=1000)
    p.add_argument("--per-class", type=int, default=1281)
    p.add_argument("--out-dir", default="/tmp/pycls_fast_bench/index_out")
    p.add_argument(
        "--no-train-net", action="store_true", help="skip the first-step timing"
    )
    p.add_argument("--json", default="", help="also write the figures here")
    return p


def make_tree(root: str, classes: int, per_class: int) -> str:
    """Creates (or reuses, when its marker says it is complete) the tree; returns the
    root. Prints a line per 100 classes with the time left."""
    from PIL import Image

    marker = os.path.join(root, f".complete_{classes}x{per_class}")
    if os.path.exists(marker):
        return root
    os.makedirs(root, exist_ok=True)
    buf = io.BytesIO()
    Image.new("RGB", (48, 40), (120, 60, 200)).save(buf, format="JPEG")
    os.makedirs(os.path.join(root, "sources"), exist_ok=True)
    start = time.perf_counter()
    for c in range(classes):
        wnid = f"n{c:08d}"
        # One source file per class: a file system caps the links to one inode
        # (65,000 on ext4).
        source = os.path.join(root, "sources", f"{wnid}.JPEG")
        with open(source, "wb") as f:
            f.write(buf.getvalue())
        for split, count in (("train", per_class), ("val", VAL_PER_CLASS)):
            d = os.path.join(root, split, wnid)
            os.makedirs(d, exist_ok=True)
            for k in range(count):
                path = os.path.join(d, f"{wnid}_{k}.JPEG")
                if not os.path.exists(path):
                    os.link(source, path)
        if (c + 1) % 100 == 0:
            left = (time.perf_counter() - start) / (c + 1) * (classes - c - 1)
            print(f"  tree: {c + 1}/{classes} classes, ~{left:.0f} s left", flush=True)
    open(marker, "w").close()
    return root


# Both child scripts: resident memory from /proc (VmRSS now, VmHWM the peak).
_STATUS = r"""
def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
"""

# Runs in a fresh interpreter: imports first, then the measured construction.
_CHILD = r"""
import json, os, sys, time
from pycls_fast.config import load_cfg
from pycls_fast.datasets.loader import construct_train_loader


cfg = load_cfg(None, json.loads(sys.argv[1]))
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # Resets VmHWM to the current resident size.
before = status("VmRSS")
t0 = time.perf_counter()
loader = construct_train_loader(cfg, rank=0, world_size=1)
batches = len(loader)
seconds = time.perf_counter() - t0
print(json.dumps({"seconds": seconds, "added_peak_bytes": status("VmHWM") - before,
                  "images": len(loader.decoder.index), "batches": batches}))
"""


# The epoch plans at ImageNet-21k size (no files needed): a folder's permutation and
# the shards' order, each cut for rank 0 of 8.
_PLAN_CHILD = r"""
import json, time
import numpy as np
from pycls_fast.datasets.modes import sharding


n, out = 14_197_122, {}
counts = np.full(6000, n // 6000)
counts[: n % 6000] += 1
for name, plan in (
    ("folder", lambda: sharding.train_batches(n, 32, 0, 3, 0, 8)),
    ("shards", lambda: sharding.split_order(
        sharding.shard_order(counts, 0, 3, 16384), 32, 0, 8)),
):
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status("VmRSS")
    t0 = time.perf_counter()
    batches = plan()
    out[name] = {"seconds": time.perf_counter() - t0,
                 "added_peak_mb": (status("VmHWM") - before) / 2**20,
                 "batches": len(batches)}
    del batches
print(json.dumps(out))
"""


def measure_plans() -> dict:
    """Time and added peak memory of the epoch plans at 14.2M images."""
    out = subprocess.run(
        [sys.executable, "-c", _STATUS + _PLAN_CHILD],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    if out.returncode:
        raise RuntimeError(f"plan measurement failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure_construction(opts: list[str]) -> dict:
    """Runs _CHILD with config `opts`; returns its figures."""
    out = subprocess.run(
        [sys.executable, "-c", _STATUS + _CHILD, json.dumps(opts)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    if out.returncode:
        raise RuntimeError(f"measurement failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def first_step_seconds(opts: list[str]) -> float:
    """Seconds from starting tools/train_net.py to its first train log line."""
    cfg = os.path.join(ROOT, "configs", "examples", "vit_digits.yaml")
    cmd = [sys.executable, os.path.join(ROOT, "tools", "train_net.py"), "--cfg", cfg]
    cmd += opts
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT
    )
    seconds = None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if '"_type": "train_iter"' in line:
            seconds = time.perf_counter() - start
            break
    proc.kill()
    proc.wait()
    if seconds is None:
        raise RuntimeError("train_net printed no train_iter line:\n" + "".join(lines))
    return seconds


def main() -> None:
    args = _parser().parse_args()
    print(
        f"index benchmark: {args.classes} x {args.per_class} images "
        f"(making the tree takes ~1 min per 1M images the first time)",
        flush=True,
    )
    root = make_tree(args.root, args.classes, args.per_class)
    cache_out = os.path.join(args.out_dir, "cache")
    subprocess.run(["rm", "-rf", args.out_dir], check=True)
    base = ["DATA.PATH", root, "MODEL.NUM_CLASSES", str(args.classes)]
    base += ["TRAIN.BATCH_SIZE", "32"]
    cold = measure_construction(base + ["OUT_DIR", cache_out])
    cached = measure_construction(base + ["OUT_DIR", cache_out])
    nocache = measure_construction(
        base + ["OUT_DIR", cache_out, "DATA.INDEX_CACHE", "False"]
    )
    result = {
        "images": cold["images"],
        "classes": args.classes,
        "cold_s": cold["seconds"],
        "cached_s": cached["seconds"],
        "nocache_s": nocache["seconds"],
        "cold_added_peak_mb": cold["added_peak_bytes"] / 2**20,
        "cached_added_peak_mb": cached["added_peak_bytes"] / 2**20,
    }
    result["projected_14m_added_peak_mb"] = (
        result["cold_added_peak_mb"] * 14_197_122 / result["images"]
    )
    for fmt, figures in measure_plans().items():
        result[f"plan_14m_{fmt}_s"] = figures["seconds"]
        result[f"plan_14m_{fmt}_added_peak_mb"] = figures["added_peak_mb"]
    if not args.no_train_net:
        run_opts = TINY + base
        out = os.path.join(args.out_dir, "train")
        result["first_step_cold_s"] = first_step_seconds(
            run_opts + ["OUT_DIR", out + "_cold"]
        )
        result["first_step_cached_s"] = first_step_seconds(
            run_opts + ["OUT_DIR", out + "_cold"]
        )
    for key, value in result.items():
        print(
            f"{key:32s} {value:.3f}"
            if isinstance(value, float)
            else f"{key:32s} {value}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
