"""The loader on a many-core node: per-image CPU and GIL-held time, projected img/s.

    python -m benchmarks.loader_scaling          # `make bench-loader-scaling`
    python -m benchmarks.loader_scaling --images 1024 --im-size 224

One decoding thread does the train work of `--images` photo-like 500x375 JPEGs (read,
decode at reduced JPEG scale, crop, resize, flip, write into the batch), timed per
image with the thread's CPU clock. The calls known to release the GIL (the file read,
Pillow's JPEG decoder, numpy's crop copy, torch's resize) are timed on their own; the
rest of the CPU time holds the GIL. With c = CPU s/image and g = GIL-held s/image,
one process with T threads on T free cores delivers at most

    images/s = min(T / c, 1 / g)

(the GIL-held part runs one thread at a time). The projection is checked against the
threads loader measured here with 1 and 2 threads. Then, for ViT-B/16 and ViT-H/16
training at an assumed share of a GPU's bf16 peak (FLOPs from `complexity`), it prints
the images/s one GPU consumes and the cores (and GIL share) its loader needs.
"""

import argparse
import json
import os
import statistics
import time

import numpy as np

# bf16 dense tensor peaks (TFLOP/s), from the vendors' data sheets.
GPU_PEAK_TFLOPS = {"A100": 312.0, "H100 SXM": 989.0}
ASSUMED_MFU = 0.4  # a share of the peak that well-tuned ViT training reaches


def _parser():
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.loader_scaling", description=__doc__.split("\n")[0]
    )
    p.add_argument("--root", default="/tmp/pycls_fast_bench_loader")
    p.add_argument("--images", type=int, default=1024)
    p.add_argument("--im-size", type=int, default=224)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--json", default="", help="also write the figures here")
    return p


class ReleasedTimer:
    """Times the GIL-releasing calls of the decode path while active, on `clock`
    (wall time by default; a thread's CPU clock where other jobs preempt it)."""

    TARGETS = (
        ("pycls_fast.datasets.formats.index", "read_file"),
        ("pycls_fast.datasets.images.decode", "decode_jpeg_rgbx"),
        ("pycls_fast.datasets.images.decode", "_resize_aa_out"),
    )

    def __init__(self, clock=time.perf_counter):
        self.seconds = 0.0
        self.clock = clock
        self._saved = []

    def __enter__(self):
        import importlib

        for module_name, attr in self.TARGETS:
            module = importlib.import_module(module_name)
            real = getattr(module, attr)

            def timed(*a, _real=real, **k):
                t0 = self.clock()
                try:
                    return _real(*a, **k)
                finally:
                    self.seconds += self.clock() - t0

            setattr(module, attr, timed)
            self._saved.append((module, attr, real))
        np_copyto = np.copyto

        def copyto(*a, **k):  # the crop copy (numpy releases the GIL)
            t0 = self.clock()
            try:
                return np_copyto(*a, **k)
            finally:
                self.seconds += self.clock() - t0

        import pycls_fast.datasets.images.decode as decode

        self._saved.append((decode.np, "copyto", np_copyto))
        decode.np.copyto = copyto
        return self

    def __exit__(self, *exc):
        for module, attr, real in reversed(self._saved):
            setattr(module, attr, real)


def measure_costs(decoder, indices) -> dict:
    """Per-image CPU and GIL-held seconds of `decoder` on `indices`, one thread."""
    out = np.empty(decoder.shape, dtype=np.uint8)
    for i in indices[:16]:  # warm-up: scratch buffers, page cache
        decoder.load_into(int(i), 0, out)
    cpu = []
    released = []
    # The thread's CPU clock, as `cpu`: wall time would count preemption by other
    # jobs as released time.
    with ReleasedTimer(time.thread_time) as timer:
        for i in indices:
            before = timer.seconds
            t0 = time.thread_time()
            decoder.load_into(int(i), 0, out)
            cpu.append(time.thread_time() - t0)
            released.append(timer.seconds - before)
    c = statistics.mean(cpu)
    r = statistics.mean(released)
    return {"cpu_ms": 1e3 * c, "released_ms": 1e3 * r, "gil_ms": 1e3 * max(c - r, 0.0)}


def projected(threads: int, cpu_ms: float, gil_ms: float) -> float:
    """Images/s of one process with `threads` threads on as many free cores."""
    return min(threads / cpu_ms, 1.0 / gil_ms if gil_ms > 0 else float("inf")) * 1e3


def measured_threads(loader, batches, threads) -> float:
    """Images/s of the threads loader on `batches` with `threads` threads."""
    lo = loader.with_plan(batches)
    lo.num_workers = threads
    lo.set_epoch(0)
    sum(len(y) for _, y in lo)  # warm-up
    t0 = time.perf_counter()
    n = sum(len(y) for _, y in lo)
    return n / (time.perf_counter() - t0)


def gpu_demand() -> list[dict]:
    """Images/s one GPU trains at ASSUMED_MFU, for ViT-B/16 and ViT-H/16 at 224."""
    from pycls_fast.config import load_cfg
    from pycls_fast.models import complexity

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    rows = []
    for name in ("ViT-B-16", "ViT-H-16"):
        cfg = load_cfg(os.path.join(here, "configs", "vit", f"{name}.yaml"), [])
        flops = complexity(cfg)["flops"]  # multiply-adds per image, forward
        train_flop = 3 * 2 * flops
        for gpu, peak in GPU_PEAK_TFLOPS.items():
            rate = ASSUMED_MFU * peak * 1e12 / train_flop
            rows.append({"model": name, "gpu": gpu, "img_per_s": rate})
    return rows


def main() -> None:
    args = _parser().parse_args()
    from pycls_fast.config import get_cfg
    from pycls_fast.datasets.formats.synthetic import make_image_folder
    from pycls_fast.datasets.loader import construct_train_loader
    from pycls_fast.datasets.modes import sharding

    per_class = 256
    classes = -(-args.images // per_class)
    stamp = os.path.join(args.root, f".complete_{classes}x{per_class}")
    if not os.path.exists(stamp):
        print(f"generating {classes * per_class} test JPEGs in {args.root} ...")
        make_image_folder(
            args.root, splits=("train",), num_classes=classes, images_per_class=256
        )
        open(stamp, "w").close()
    cfg = get_cfg()
    cfg.DATA.PATH, cfg.DATA.INDEX_CACHE = args.root, False
    cfg.TRAIN.IM_SIZE, cfg.TRAIN.BATCH_SIZE = args.im_size, args.batch_size
    cfg.MODEL.NUM_CLASSES = 100_000
    loader = construct_train_loader(cfg)
    batches = sharding.train_batches(args.images, args.batch_size, 0, 0, 0, 1)
    indices = np.concatenate(batches)
    print(f"{len(indices)} images, one thread, then the loader with 1 and 2 threads")
    costs = measure_costs(loader.decoder, indices)
    checks = {
        t: {
            "measured": measured_threads(loader, batches, t),
            "projected": projected(t, costs["cpu_ms"], costs["gil_ms"]),
        }
        for t in (1, 2)
    }
    ceiling = projected(10**6, costs["cpu_ms"], costs["gil_ms"])
    result = {**costs, "gil_share": costs["gil_ms"] / costs["cpu_ms"]}
    result.update(checks={str(t): v for t, v in checks.items()}, ceiling=ceiling)
    print(
        f"per image: {costs['cpu_ms']:.2f} ms CPU, of which {costs['gil_ms']:.3f} ms "
        f"hold the GIL ({100 * result['gil_share']:.1f}%)"
    )
    for t, v in checks.items():
        print(
            f"{t} thread(s): measured {v['measured']:.0f} img/s, "
            f"projected {v['projected']:.0f}"
        )
    print(f"one process's GIL ceiling: {ceiling:.0f} img/s")
    print("| threads | projected img/s, one process |")
    print("|---|---|")
    for t in (4, 8, 16, 32, 64):
        print(f"| {t} | {projected(t, costs['cpu_ms'], costs['gil_ms']):.0f} |")
    demand = gpu_demand()
    print(f"| model | GPU (at {ASSUMED_MFU:.0%} of bf16 peak) | img/s per GPU | "
          "cores per GPU | share of one process's GIL |")  # fmt: skip
    print("|---|---|---|---|---|")
    for row in demand:
        row["cores"] = row["img_per_s"] * costs["cpu_ms"] / 1e3
        row["gil_share"] = row["img_per_s"] / ceiling
        print(
            f"| {row['model']} | {row['gpu']} | {row['img_per_s']:.0f} | "
            f"{row['cores']:.1f} | {row['gil_share']:.2f} |"
        )
    result["gpu_demand"] = demand
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
