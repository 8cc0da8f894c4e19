"""Shards vs folder: the same images, threads mode, side by side; and the system calls.

    python -m benchmarks.shards                  # `make bench-shards`
    python -m benchmarks.shards --images 4096 --workers 8 --rounds 5

Generates photo-like 500x375 JPEGs (once, reused), packs them into tar shards
(tools/pack_dataset.py's code), and times whole train epochs over the same images in
DATA_LOADER.MODE threads, one DATA.FORMAT after the other in each round (medians, and
the median of per-round ratios). It counts, for the first epoch of each, the file system
calls the loader makes through Python's `os` module (the only way it reaches files):
opens, fstat/stat (metadata), reads. On a local disk with a warm page cache the times
show the CPU cost of each format; on a network file system every open and stat is a
round trip to the server, which is what shards remove.
"""

import argparse
import json
import os
import statistics
import time

ROOT_DEFAULT = "/tmp/pycls_fast_bench_shards"
COUNTED = ("open", "close", "fstat", "stat", "read", "pread", "scandir")


def _parser():
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.shards", description=__doc__.split("\n")[0]
    )
    p.add_argument("--root", default=ROOT_DEFAULT, help="where to generate the data")
    p.add_argument("--images", type=int, default=2048, help="images per epoch")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--workers", type=int, default=os.cpu_count())
    p.add_argument("--shard-mb", type=float, default=32)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", default="", help="also write the figures here")
    return p


def prepare(root: str, images: int, shard_mb: float) -> tuple[str, str]:
    """(folder root, shards root) with `images` train images, made once."""
    from pycls_fast.datasets.formats.index import load_index
    from pycls_fast.datasets.formats.pack import pack_split
    from pycls_fast.datasets.formats.synthetic import make_image_folder

    per_class = 256
    classes = -(-images // per_class)
    folder = os.path.join(root, "folder")
    shards = os.path.join(root, f"shards_{shard_mb:g}mb")
    stamp = os.path.join(root, f".complete_{classes}x{per_class}_{shard_mb:g}")
    if not os.path.exists(stamp):
        print(f"generating {classes * per_class} JPEGs and their shards in {root}")
        make_image_folder(
            folder, splits=("train",), num_classes=classes, images_per_class=per_class
        )
        pack_split(load_index(folder, "train"), shards, "train", int(shard_mb * 2**20))
        open(stamp, "w").close()
    return folder, shards


def _cfg(path, fmt, args):
    from pycls_fast.config import get_cfg

    cfg = get_cfg()
    cfg.DATA.PATH, cfg.DATA.FORMAT, cfg.DATA.INDEX_CACHE = path, fmt, False
    cfg.TRAIN.BATCH_SIZE = args.batch_size
    cfg.DATA_LOADER.NUM_WORKERS = args.workers
    cfg.MODEL.NUM_CLASSES = 100_000
    return cfg


def _epoch(loader):
    loader.set_epoch(0)
    images = 0
    for _, labels in loader:
        images += len(labels)
    return images


class SyscallCounter:
    """Counts calls of os.open, os.fstat, ... while active (a context manager)."""

    def __init__(self):
        self.counts = dict.fromkeys(COUNTED, 0)
        self._saved = {}

    def __enter__(self):
        for name in COUNTED:
            real = getattr(os, name)
            self._saved[name] = real

            def counted(*a, _real=real, _name=name, **k):
                self.counts[_name] += 1  # A race may lose a count: +-1 of thousands.
                return _real(*a, **k)

            setattr(os, name, counted)
        return self

    def __exit__(self, *exc):
        for name, real in self._saved.items():
            setattr(os, name, real)


def main() -> None:
    args = _parser().parse_args()
    from pycls_fast.datasets.loader import construct_train_loader

    folder, shards = prepare(args.root, args.images, args.shard_mb)
    loaders = {}
    counts = {}
    for fmt, path in (("folder", folder), ("shards", shards)):
        with SyscallCounter() as c:
            loader = construct_train_loader(_cfg(path, fmt, args))
        counts[f"{fmt}_index"] = c.counts
        # The same number of images: the first images of the epoch's plan.
        plan = loader.plan(0)[: args.images // args.batch_size]
        loaders[fmt] = loader.with_plan(plan)
    images = {}
    t0 = time.perf_counter()
    for fmt, lo in loaders.items():  # the first epoch: warm-up, and calls counted
        with SyscallCounter() as c:
            images[fmt] = _epoch(lo)
        counts[f"{fmt}_epoch"] = c.counts
    print(
        f"{images['folder']} images per epoch, {args.workers} threads, "
        f"~{args.rounds * (time.perf_counter() - t0):.0f} s expected",
        flush=True,
    )
    rates = {fmt: [] for fmt in loaders}
    for r in range(args.rounds):
        for fmt, lo in loaders.items():
            t0 = time.perf_counter()
            n = _epoch(lo)
            rates[fmt].append(n / (time.perf_counter() - t0))
        print(f"  round {r + 1}/{args.rounds}", flush=True)
    ratios = [s / f for s, f in zip(rates["shards"], rates["folder"], strict=True)]
    result = {
        "images": images["folder"],
        "workers": args.workers,
        "folder_img_per_s": statistics.median(rates["folder"]),
        "shards_img_per_s": statistics.median(rates["shards"]),
        "shards_over_folder": statistics.median(ratios),
        "calls": counts,
    }
    print(
        f"| format | img/s (median of {args.rounds}) | first epoch: opens | "
        "stat+fstat | reads |"
    )
    print("|---|---|---|---|---|")
    for fmt in loaders:
        c = counts[f"{fmt}_epoch"]
        print(
            f"| {fmt} | {result[f'{fmt}_img_per_s']:.0f} | {c['open']} | "
            f"{c['stat'] + c['fstat']} | {c['read'] + c['pread']} |"
        )
    print(f"shards / folder: {result['shards_over_folder']:.3f} (median per round)")
    for fmt in loaders:
        c = counts[f"{fmt}_index"]
        print(f"index of {fmt}: {json.dumps(c)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
