"""Loader benchmark: threaded vs spdl vs ideal vs torch DataLoader, images/s and memory.

    python -m benchmarks.loader                  # `make bench-loader`
    python -m benchmarks.loader --data /datasets/imagenet --images 4096 --workers 8

On one image folder (generated photo-like 500x375 JPEGs unless --data is given), in one
run, interleaved round by round (single, threads, processes, ...; medians):
- single: the per-image work (decode, crop, resize, flip, write into the batch) in one
  thread, no loader; the ideal is min(workers, cores) x this rate;
- ceiling: the same work split over `workers` independent processes that send nothing
  back (forked once before any timing, so no fork, start-up or exit is timed): what
  the cores deliver in parallel, with no loader at all;
- threads: DATA_LOADER.MODE threads (decoding threads fed by the consumer);
- spdl: DATA_LOADER.MODE spdl (the same chunk tasks in an spdl.pipeline);
- threads-per-image: an spdl pipeline with one task per image (for comparison);
- subprocess: DATA_LOADER.MODE subprocess (the threads in one child process, batches
  through shared memory; the child is started before timing, as it lives for a run);
- processes: DATA_LOADER.MODE processes (torch DataLoader, same work and workers).
Each loader figure is a whole epoch over --images images, start-up included; "CPU ms /
image" is the CPU time of the process and its (finished) workers per image, which shows
the overhead of each mode even when other jobs share the cores. Peak
memory is measured afterwards, one fresh child process per mode: the peak over time of
the anonymous + shared-memory PSS (proportional set size: pages shared between
processes are split between them) summed over the child and its worker processes,
sampled every 20 ms; "idle" is a child that imports everything and builds the index but
loads nothing. RSS summed over the processes is shown too: it counts shared pages once
per process, as `top` does.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import numpy as np

from benchmarks.harness import (
    descendants_cpu_seconds,
    machine_busy_seconds,
    per_round_ratios,
    process_cpu_seconds,
)
from pycls_fast.config import get_cfg
from pycls_fast.errors import UserError
from pycls_fast.launch.cli import run

MODES = (
    "single",
    "ceiling",
    "threads",
    "spdl",
    "subprocess",
    "threads-per-image",
    "processes",
)
LOADERS = ("threads", "spdl", "subprocess", "threads-per-image", "processes")


def _parser():
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.loader", description=__doc__.split("\n")[0]
    )
    p.add_argument(
        "--data", default="", help="ImageNet-layout root (default: generate)"
    )
    p.add_argument(
        "--gen-dir",
        default="/tmp/pycls_fast_bench_loader",
        help="where to generate the test images when --data is not given",
    )
    p.add_argument("--split", default="train", help="split folder to read")
    p.add_argument("--images", type=int, default=4096, help="images per epoch")
    p.add_argument("--batch-size", type=int, default=64, help="images per batch")
    p.add_argument("--workers", type=int, default=os.cpu_count(), help="threads/procs")
    p.add_argument("--im-size", type=int, default=224, help="TRAIN.IM_SIZE")
    p.add_argument("--augment", default="", help="TRAIN.AUGMENT, e.g. AutoAugment")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    p.add_argument(
        "--max-foreign",
        type=float,
        default=0.15,
        help="repeat a run during which other jobs used more CPU cores than this",
    )
    p.add_argument(
        "--max-tries", type=int, default=20, help="tries per run before keeping one"
    )
    p.add_argument("--no-memory", action="store_true", help="skip the memory runs")
    p.add_argument("--json", action="store_true", help="end with one JSON line")
    p.add_argument("--child", choices=(*MODES, "idle"), help=argparse.SUPPRESS)
    return p


def _cfg(args, root):
    cfg = get_cfg()
    cfg.DATA.PATH = root
    cfg.TRAIN.SPLIT = args.split
    cfg.DATA.INDEX_CACHE = False
    cfg.TRAIN.IM_SIZE = args.im_size
    cfg.TRAIN.AUGMENT = args.augment
    cfg.TRAIN.BATCH_SIZE = args.batch_size
    cfg.DATA_LOADER.NUM_WORKERS = args.workers
    cfg.MODEL.NUM_CLASSES = 100_000
    return cfg


def _data_root(args):
    if args.data:
        return args.data
    from pycls_fast.datasets.formats.synthetic import make_image_folder

    root = args.gen_dir
    per_class, classes = 256, -(-args.images // 256)
    stamp = os.path.join(root, f".complete_{classes}x{per_class}")
    if not os.path.exists(stamp):
        print(f"generating {classes * per_class} test JPEGs in {root} ...", flush=True)
        make_image_folder(
            root, splits=(args.split,), num_classes=classes, images_per_class=per_class
        )
        open(stamp, "w").close()
    return root


class Bench:
    """The ways (MODES) of producing the same epoch of batches."""

    def __init__(self, args, root):
        from pycls_fast.datasets import loader
        from pycls_fast.datasets.modes import sharding

        self.args = args
        self.cfg = _cfg(args, root)
        train = loader.construct_train_loader(self.cfg)
        num = min(args.images, len(train.decoder.index))
        if num < args.images:
            raise UserError(f"{root}/{args.split} has only {num} images")
        # The same `num` images, in one fixed shuffled order, for every mode.
        batches = sharding.train_batches(num, args.batch_size, 0, 0, 0, 1)
        self.batches = batches
        self.loaders = {m: train.with_plan(batches, m) for m in loader.MODES}
        self.decoder = train.decoder
        self.images = sum(len(b) for b in batches)
        self.ceiling_workers = []  # (process, pipe); see start_ceiling_workers.
        self.worker_cpu = 0.0  # CPU seconds of live workers in the current run.

    def start_ceiling_workers(self):
        """Forks the `ceiling` processes, each owning a contiguous share of the
        batches; done once, before anything has run (no threads to fork)."""
        import multiprocessing

        ctx = multiprocessing.get_context("fork")
        for part in np.array_split(np.arange(len(self.batches)), self.args.workers):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=self._ceiling_worker, args=(part, child), daemon=True
            )
            proc.start()
            self.ceiling_workers.append((proc, parent))

    def stop_ceiling_workers(self):
        for proc, pipe in self.ceiling_workers:
            pipe.send(None)
            proc.join()
        self.ceiling_workers = []

    def _ceiling_worker(self, which, pipe):
        # Decodes its batches each time it is told to; answers with the CPU it used.
        while pipe.recv() is not None:
            cpu0 = time.process_time()
            for b in which:
                self.decoder.load_batch(self.batches[b], 0)
            pipe.send(time.process_time() - cpu0)

    def run(self, mode):
        """Runs one epoch in `mode`; returns (images/s with start-up included, CPU ms
        per image of this process and its finished worker processes)."""
        if mode == "idle":  # Memory baseline: everything imported, nothing decoded.
            time.sleep(0.5)
            return 0.0, 0.0
        t0, cpu0, busy0 = (
            time.perf_counter(),
            process_cpu_seconds(),
            machine_busy_seconds(),
        )
        self.worker_cpu = 0.0
        count = getattr(self, "_" + mode.replace("-", "_"))()
        wall = time.perf_counter() - t0
        cpu = process_cpu_seconds() - cpu0 + self.worker_cpu
        # CPU that other jobs took meanwhile, in cores (NaN where /proc/stat is not).
        self.foreign = (machine_busy_seconds() - busy0 - cpu) / wall
        assert count == self.images, (mode, count)
        return count / wall, 1000 * cpu / count

    def _single(self):
        return sum(len(self.decoder.load_batch(b, 0).labels) for b in self.batches)

    def _ceiling(self):
        for _, pipe in self.ceiling_workers:
            pipe.send(True)
        for proc, pipe in self.ceiling_workers:
            while not pipe.poll(1.0):
                if not proc.is_alive():
                    raise RuntimeError(f"a ceiling process failed ({proc.exitcode})")
            self.worker_cpu += pipe.recv()
        return self.images

    def _threads(self):
        return sum(len(y) for _, y in self.loaders["threads"])

    def _spdl(self):
        return sum(len(y) for _, y in self.loaders["spdl"])

    def _subprocess(self):
        # The children live across epochs: their CPU is read from /proc.
        before = sum(descendants_cpu_seconds().values())
        count = sum(len(y) for _, y in self.loaders["subprocess"])
        self.worker_cpu += sum(descendants_cpu_seconds().values()) - before
        return count

    def _processes(self):
        return sum(len(y) for _, y in self.loaders["processes"])

    def _threads_per_image(self):
        from spdl.pipeline import PipelineBuilder

        from pycls_fast.datasets.modes.batch import make_batch

        decoder = self.decoder

        def collate(items):
            images = [x for x, _, _ in items]
            return make_batch(np.stack(images), np.zeros(len(images)), [])

        pipeline = (
            PipelineBuilder()
            .add_source(np.concatenate(self.batches).tolist())
            .pipe(lambda i: decoder.load(i, 0), concurrency=self.args.workers)
            .aggregate(self.args.batch_size)
            .pipe(collate)
            .add_sink(self.cfg.DATA_LOADER.PREFETCH)
            .build(num_threads=self.args.workers)
        )
        with pipeline.auto_stop():
            return sum(len(b.labels) for b in pipeline)


def _tree_memory(proc):
    """(anonymous + shared-memory PSS, RSS) in bytes, summed over psutil process
    `proc` and its children.

    PSS splits each page between the processes that map it, so summing it over a fork
    tree counts the pages that workers share with their parent once. Only anonymous
    and shmem pages count: file pages (torch's libraries) are also split with any
    other job that maps them, which would make the figure depend on those jobs.
    """
    import psutil

    pss = rss = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            with open(f"/proc/{p.pid}/smaps_rollup") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            kb = int(fields["Pss_Anon"].split()[0]) + int(
                fields["Pss_Shmem"].split()[0]
            )
            pss, rss = pss + kb * 1024, rss + p.memory_info().rss
        except (OSError, KeyError, psutil.NoSuchProcess):
            pass
    return pss, rss


def _peak_memory(mode):
    """Runs one epoch of `mode` in a fresh child process; returns peak (PSS, RSS) MB."""
    import psutil

    argv = [a for a in sys.argv[1:] if a != "--json"]
    child = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.loader", *argv, "--child", mode]
    )
    proc = psutil.Process(child.pid)
    peak_pss = peak_rss = 0
    while child.poll() is None:
        pss, rss = _tree_memory(proc)
        peak_pss, peak_rss = max(peak_pss, pss), max(peak_rss, rss)
        time.sleep(0.02)
    if child.returncode:
        raise RuntimeError(f"memory run of {mode} failed ({child.returncode})")
    return peak_pss / 2**20, peak_rss / 2**20


def _versions():
    import PIL
    import spdl
    import torch
    from PIL import features

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(ln.split(":", 1)[1].strip() for ln in f if "model name" in ln)
    except (OSError, StopIteration):
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "pillow": PIL.__version__,
        "libjpeg_turbo": features.version("libjpeg_turbo"),
        "spdl": getattr(spdl, "__version__", "?"),
    }


def _table(args, rates, cpu, memory, info):
    med = {m: statistics.median(rates[m]) for m in MODES}
    cores_used = min(args.workers, os.cpu_count())
    ideal = cores_used * med["single"]
    nan = float("nan")
    lines = [
        f"{args.images} images, batch {args.batch_size}, {args.im_size} px train "
        f"transforms{' + ' + args.augment if args.augment else ''}, "
        f"{args.workers} workers, {args.rounds} interleaved rounds (median, min-max)",
        f"{info['cpu']}, {info['cores']} cores; python {info['python']}, torch "
        f"{info['torch']}, pillow {info['pillow']} (libjpeg-turbo "
        f"{info['libjpeg_turbo']}), spdl {info['spdl']}",
        "",
        "| mode | images/s | / ideal | / ceiling | / processes | CPU ms / image "
        "| peak anon PSS MB (over idle) | peak RSS sum MB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    idle = memory.get("idle", (nan,))[0]
    for mode in MODES:
        r, m = rates[mode], med[mode]
        pss, rss = memory.get(mode, (nan, nan))
        mem = f"{pss:.0f} (+{pss - idle:.0f}) | {rss:.0f}" if mode in memory else "|"
        lines.append(
            f"| {mode} | {m:.0f} ({min(r):.0f}-{max(r):.0f}) | {m / ideal:.2f} | "
            f"{m / med['ceiling']:.2f} | {m / med['processes']:.2f} | "
            f"{statistics.median(cpu[mode]):.2f} | {mem} |"
        )
    lines.append(f"| ideal ({cores_used} x single) | {ideal:.0f} | 1.00 | | | | | |")
    if memory:
        lines.append(f"| idle (imports + index, no loading) | | | | | | {idle:.0f} | |")
    per_round = {
        "threads_over_ideal": per_round_ratios(
            rates["threads"], rates["single"], cores_used
        ),
        "threads_over_processes": per_round_ratios(
            rates["threads"], rates["processes"]
        ),
    }
    lines.append("")
    for name, values in per_round.items():
        lines.append(
            f"{name.replace('_', ' ')}, per round: "
            + " ".join(f"{v:.2f}" for v in values)
            + f"; median {statistics.median(values):.3f}"
        )
    return "\n".join(lines), {
        "images_per_s": med,
        "ideal": ideal,
        "threads_over_ideal": med["threads"] / ideal,
        "threads_over_ceiling": med["threads"] / med["ceiling"],
        "threads_over_processes": med["threads"] / med["processes"],
        **{f"{k}_per_round_median": statistics.median(v) for k, v in per_round.items()},
        "cpu_ms_per_image": {m: statistics.median(cpu[m]) for m in MODES},
        "peak_pss_mb": {m: v[0] for m, v in memory.items()},
        **info,
    }


def main():
    args = _parser().parse_args()
    root = _data_root(args)
    bench = Bench(args, root)
    if args.child:
        bench.run(args.child)
        return 0
    bench.start_ceiling_workers()
    bench.run("threads")  # Warm the page cache and the code paths.
    bench.run("subprocess")  # Start its child, which a run keeps for its epochs.
    rates, cpu = {m: [] for m in MODES}, {m: [] for m in MODES}
    repeats, foreign_kept = 0, 0.0
    for r in range(args.rounds):
        for mode in MODES:
            # A run during which other jobs took CPU is repeated, --max-tries times.
            for _ in range(args.max_tries):
                rate, cpu_ms = bench.run(mode)
                if not bench.foreign > args.max_foreign:
                    break
                repeats += 1
            foreign_kept = max(foreign_kept, bench.foreign)
            rates[mode].append(rate)
            cpu[mode].append(cpu_ms)
        print(
            f"round {r + 1}/{args.rounds}: "
            + ", ".join(f"{m} {rates[m][-1]:.0f}/s" for m in MODES)
            + f" ({repeats} contended runs repeated so far)",
            flush=True,
        )
    bench.stop_ceiling_workers()
    print(
        f"other jobs used at most {foreign_kept:.2f} cores during the kept runs; "
        f"{repeats} contended runs were repeated"
    )
    memory = {}
    if not args.no_memory:
        memory = {m: _peak_memory(m) for m in ("idle", "single", *LOADERS)}
    table, record = _table(args, rates, cpu, memory, _versions())
    print(table)
    if args.json:
        print(json.dumps(record))
    return 0


if __name__ == "__main__":
    run(main)
