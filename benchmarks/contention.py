"""The loader beside the step: how much a loader mode slows a host-bound training step.

    python -m benchmarks.contention                    # `make bench-contention`
    python -m benchmarks.contention --rounds 5 --recipes deit --modes threads,subprocess

A GPU's training thread spends its step launching kernels: hundreds of small eager ops,
each releasing and re-taking the GIL. This benchmark puts such a step on the CPU: the
ViT of the step config (ViT-B/16's 12 blocks at width 32, 32 px, batch 2, SGD, one
intra-op thread: ~5 ms of small ops) trains on one cached batch, while a real loader
(`construct_train_loader`, --workers decoding threads or processes, 224 px) decodes
photo-like JPEGs with a recipe's train transforms. The training loop takes one loader
batch before each step, as a real run does; only the step is timed. Per cell, in
interleaved rounds (every recipe x mode once per round; medians over rounds):

- step ms: wall time of the step; "slowdown": over the same step with no loader
  ('none': the step alone, its batches cached);
- step CPU ms: the training thread's own CPU time in the step; wall minus CPU is time
  the thread was ready but not running: waiting for the GIL (or a core);
- batch wait ms: the loop's wait for each batch (the thread idles before its step
  when the loader is slower than the step);
- switches / step: the training thread's voluntary and involuntary context switches
  during the step (/proc/thread-self/status): a GIL wait is a voluntary one;
- loader img/s: images the loader delivered over the cell's wall time.

Modes: 'none', 'threads', 'spdl', 'subprocess' (DATA_LOADER.MODE) and 'processes'
(torch's DataLoader), and two controls. 'idle': the step alone after sleeping
--idle-ms before each step, as a loop whose loader is slower than its step waits (a
step right after a wait can be slower: docs/PERFORMANCE.md). 'busy': a child
process running the recipe's loader in 'threads' mode (the same decoding and
augmentation, the same threads) and dropping its batches, handing nothing back. It
shares nothing with the step but the machine, so what the step loses beside it is
the work's and the hardware's (cores that share caches, memory or a host), not a
loader design's: the floor for any loader in another process, and "over busy" is
what a mode costs beyond it. Recipes: the train data keys of a shipped config (see
RECIPES).
"""

import argparse
import atexit
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time

import torch

from benchmarks.harness import descendants_cpu_seconds, machine_busy_seconds

# Recipe families: the config whose train transforms a run of that recipe uses.
RECIPES = {
    "crop-flip": "configs/vit/ViT-B-16.yaml",
    "pycls": "configs/pycls/ViT-P-4GF.yaml",
    "deit": "configs/deit/deit_s.yaml",
    "deit3": "configs/deit/deit3_s.yaml",
    "augreg": "configs/augreg/ViT-B-16.yaml",
}
# The keys of a recipe that decide the host's per-image work.
RECIPE_KEYS = (
    "TRAIN.AUGMENT",
    "TRAIN.AUGMENT_INTERPOLATION",
    "TRAIN.COLOR_JITTER",
    "TRAIN.THREE_AUGMENT",
    "DATA.TRAIN_CROP",
    "DATA.CROP_SCALE",
    "DATA.HFLIP",
)
MODES = ("none", "idle", "busy", "threads", "spdl", "subprocess", "processes")
# Modes whose figures do not depend on the recipe: one row each.
NO_RECIPE = ("none", "idle")
# Seconds between runs: what a stopped loader was finishing is done before the next.
SETTLE_S = 0.3


def _parser():
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.contention", description=__doc__.split("\n")[0]
    )
    p.add_argument(
        "--recipes", default="crop-flip,deit", help="of " + ",".join(RECIPES)
    )
    p.add_argument("--modes", default=",".join(MODES), help="of " + ",".join(MODES))
    p.add_argument("--workers", type=int, default=1, help="decoding threads/processes")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seconds", type=float, default=4.0, help="per cell and round")
    p.add_argument("--images", type=int, default=512, help="images in the folder")
    p.add_argument("--batch-size", type=int, default=8, help="loader batch")
    p.add_argument("--im-size", type=int, default=224, help="loader crop size")
    p.add_argument("--step-depth", type=int, default=12, help="blocks of the step")
    p.add_argument("--step-width", type=int, default=32, help="width of the step")
    p.add_argument("--step-batch", type=int, default=2)
    p.add_argument("--gen-dir", default="/tmp/pycls_fast_bench_contention")
    p.add_argument(
        "--max-foreign",
        type=float,
        default=0.15,
        help="repeat a cell while other jobs used more cores than this",
    )
    p.add_argument("--max-tries", type=int, default=5)
    p.add_argument("--json", default="", help="also write the figures here")
    p.add_argument(
        "--idle-ms",
        type=float,
        default=25.0,
        help="the 'idle' control's sleep before each step",
    )
    p.add_argument("--busy-child", default="", help=argparse.SUPPRESS)
    return p  # fmt: skip


def _data(args):
    from pycls_fast.datasets.formats.synthetic import make_image_folder

    per_class, classes = 64, max(1, -(-args.images // 64))
    stamp = os.path.join(args.gen_dir, f".complete_{classes}x{per_class}")
    if not os.path.exists(stamp):
        print(
            f"generating {classes * per_class} JPEGs in {args.gen_dir} ...", flush=True
        )
        make_image_folder(args.gen_dir, ("train",), classes, per_class)
        open(stamp, "w").close()
    return args.gen_dir, classes


def loader_for(args, recipe, mode, root, classes):
    """The train loader of `recipe` (a RECIPES name) in `mode` over `root`."""
    from pycls_fast.config import get_cfg, load_cfg
    from pycls_fast.datasets.loader import construct_train_loader

    source = load_cfg(RECIPES[recipe])
    cfg = get_cfg()
    for key in RECIPE_KEYS:
        node, name = key.split(".")
        cfg[node][name] = source[node][name]
    cfg.DATA.PATH, cfg.DATA.INDEX_CACHE = root, False
    cfg.OUT_DIR = os.path.join(args.gen_dir, "out")
    cfg.MODEL.NUM_CLASSES = classes
    cfg.TRAIN.IM_SIZE, cfg.TRAIN.BATCH_SIZE = args.im_size, args.batch_size
    cfg.DATA_LOADER.NUM_WORKERS = args.workers
    cfg.DATA_LOADER.MODE = mode
    cfg.DATA_LOADER.PIN_MEMORY = False
    cfg.DATA_LOADER.MAX_BAD_FRAC = 0.5  # speed, not data, is measured here
    return construct_train_loader(cfg, rank=0, world_size=1)


def make_step(args):
    """A host-bound training step: () -> None."""
    from pycls_fast.config import get_cfg
    from pycls_fast.models import build_model

    cfg = get_cfg()
    cfg.TRAIN.IM_SIZE, cfg.VIT.PATCH_SIZE = 32, 16
    cfg.VIT.NUM_LAYERS, cfg.VIT.HIDDEN_DIM = args.step_depth, args.step_width
    cfg.VIT.MLP_DIM, cfg.VIT.NUM_HEADS = 4 * args.step_width, 2
    cfg.MODEL.NUM_CLASSES = 10
    torch.manual_seed(0)
    model = build_model(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    x = torch.randn(args.step_batch, 3, 32, 32)
    y = torch.randint(0, 10, (args.step_batch,))

    def step():
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def _switches():
    """The calling thread's (voluntary, involuntary) context switches so far."""
    with open("/proc/thread-self/status") as f:
        fields = dict(ln.split(":", 1) for ln in f if "ctxt_switches" in ln)
    return int(fields["voluntary_ctxt_switches"]), int(
        fields["nonvoluntary_ctxt_switches"]
    )


class Busy:
    """The 'busy' control's child process (this module with --busy-child RECIPE),
    stopped (SIGSTOP) between its runs."""

    def __init__(self, argv: list[str], recipe: str):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.contention", *argv,
             "--busy-child", recipe],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError("the busy control's child did not start")
        self.pause()
        atexit.register(self.close)  # a stopped child must not outlive the run

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def pause(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def cpu_seconds(self) -> float:
        """The child's CPU seconds so far."""
        return descendants_cpu_seconds().get(self.proc.pid, 0.0)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class Cell:
    """One (recipe, mode): its loader or busy control (kept across rounds) and its
    runs."""

    def __init__(self, loader, busy: Busy | None = None, idle_s: float = 0.0):
        self.loader = loader
        self.busy = busy
        self.idle_s = idle_s
        self.epoch = 0

    def _batches(self):
        while self.loader is not None:
            self.loader.set_epoch(self.epoch)
            self.epoch += 1
            yield from self.loader

    def run(self, step, seconds):
        """Runs the loop for `seconds`; returns the figures of the run."""
        walls, cpus, vol, invol, images = [], [], 0, 0, 0
        # A fresh epoch each run, closed at its end: no cell's decoding runs on
        # into the next one's. The first batch (the loader's start) is not counted.
        batches = self._batches()
        next(batches, None)
        if self.busy is not None:
            child0 = self.busy.cpu_seconds()
            self.busy.resume()
        busy0, own0 = machine_busy_seconds(), _own_cpu()
        start = time.perf_counter()
        waits = []
        while time.perf_counter() - start < seconds:
            t_next = time.perf_counter()
            batch = next(batches, None)
            if self.idle_s:
                time.sleep(self.idle_s)  # as if waiting for a slower loader
            waits.append(time.perf_counter() - t_next)
            if batch is not None:
                images += len(batch[1])
            del batch
            v0, i0 = _switches()
            c0, t0 = time.thread_time(), time.perf_counter()
            step()
            t1, c1 = time.perf_counter(), time.thread_time()
            v1, i1 = _switches()
            walls.append(t1 - t0)
            cpus.append(c1 - c0)
            vol, invol = vol + v1 - v0, invol + i1 - i0
        wall = time.perf_counter() - start
        own = _own_cpu() - own0
        foreign = (machine_busy_seconds() - busy0 - own) / wall
        child = 0.0
        if self.busy is not None:
            self.busy.pause()
            child = self.busy.cpu_seconds() - child0
        batches.close()  # stops the threads, workers or subprocess work
        time.sleep(SETTLE_S)
        return {
            "step_ms": 1e3 * statistics.median(walls),
            "step_cpu_ms": 1e3 * statistics.median(cpus),
            # The loop's wait for each batch: the training thread idles this long
            # before each step when the loader is slower than the step.
            "next_ms": 1e3 * statistics.mean(waits),
            "voluntary": vol / len(walls),
            "involuntary": invol / len(walls),
            "img_per_s": images / wall,
            "foreign": max(0.0, foreign),
            # Cores this process and its children (loader, busy control) used.
            "own_cores": own / wall,
            "busy_cpu_s": child,  # the busy control's child's CPU in the run
        }


_seen_cpu = {}  # pid -> CPU seconds at the last reading


def _own_cpu():
    """CPU seconds of this process and the descendants seen so far (loader
    subprocesses, DataLoader workers; one that ended keeps its last reading)."""
    t = os.times()
    _seen_cpu.update(descendants_cpu_seconds())
    return t.user + t.system + sum(_seen_cpu.values())


def _busy_child(args) -> None:
    """The 'busy' control: the recipe's loader in 'threads' mode, its batches
    dropped, epoch after epoch, until killed."""
    parent = os.getppid()

    def watch():  # ends with the benchmark, however it ends
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, daemon=True).start()
    root, classes = _data(args)
    loader = loader_for(args, args.busy_child, "threads", root, classes)
    print("ready", flush=True)
    epoch = 0
    while True:
        loader.set_epoch(epoch)
        epoch += 1
        for _ in loader:
            pass


def main():
    args = _parser().parse_args()
    torch.set_num_threads(1)
    if args.busy_child:
        return _busy_child(args)
    recipes, modes = args.recipes.split(","), args.modes.split(",")
    for name in recipes:
        if name not in RECIPES:
            raise SystemExit(
                f"error: --recipes: {name!r} is not one of {list(RECIPES)}"
            )
    for name in modes:
        if name not in MODES:
            raise SystemExit(f"error: --modes: {name!r} is not one of {list(MODES)}")
    root, classes = _data(args)
    step = make_step(args)
    for _ in range(20):
        step()
    cells = {}
    for recipe in recipes:
        for mode in modes:
            if mode in NO_RECIPE:
                if recipe == recipes[0]:
                    idle = args.idle_ms / 1e3 if mode == "idle" else 0.0
                    cells[recipe, mode] = Cell(None, idle_s=idle)
            elif mode == "busy":
                cells[recipe, mode] = Cell(None, Busy(sys.argv[1:], recipe))
            else:
                cells[recipe, mode] = Cell(
                    loader_for(args, recipe, mode, root, classes)
                )
    runs = {key: [] for key in cells}
    total = args.rounds * len(cells) * args.seconds
    print(f"{len(cells)} cells x {args.rounds} rounds x {args.seconds} s: about "
          f"{total / 60:.1f} min", flush=True)  # fmt: skip
    for r in range(args.rounds):
        for key, cell in cells.items():
            best = None
            for _ in range(args.max_tries):
                run = cell.run(step, args.seconds)
                if best is None or run["foreign"] < best["foreign"]:
                    best = run
                if not run["foreign"] > args.max_foreign:
                    break
            runs[key].append(best)
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    for cell in cells.values():
        if cell.loader is not None and hasattr(cell.loader, "close"):
            cell.loader.close()
        if cell.busy is not None:
            cell.busy.close()
    figures = _figures(args, runs, recipes, modes)
    print(_table(args, figures, recipes, modes))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)


def _figures(args, runs, recipes, modes):
    alone = runs[recipes[0], "none"]
    rows = []
    for recipe in recipes:
        for mode in modes:
            if mode in NO_RECIPE and recipe != recipes[0]:
                continue  # one row for the step alone
            these = runs[recipe, mode]
            med = {k: statistics.median(r[k] for r in these) for k in these[0]}
            # Per round: this cell's step over the step alone in the same round.
            ratios = [r["step_ms"] / a["step_ms"] for r, a in zip(these, alone)]
            row = {
                "recipe": recipe, "mode": mode, **med,
                "slowdown": statistics.median(ratios), "slowdown_rounds": ratios,
                "step_rounds_ms": [r["step_ms"] for r in these],
                "foreign_max": max(r["foreign"] for r in these),
            }  # fmt: skip
            floor = runs.get((recipe, "busy"))
            if floor is not None:
                # Over the busy control in the same round: what this mode costs
                # the step beyond the machine's own floor (rounds taken minutes
                # apart on a host that varies compare each to its neighbour).
                over = [r["step_ms"] / b["step_ms"] for r, b in zip(these, floor)]
                row["over_busy"] = statistics.median(over)
            rows.append(row)
    return {"args": vars(args), "versions": _versions(), "rows": rows}


def _versions():
    import platform

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(ln.split(":", 1)[1].strip() for ln in f if "model name" in ln)
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__,
            "python": platform.python_version()}  # fmt: skip


def _table(args, figures, recipes, modes):
    v = figures["versions"]
    lines = [
        f"{v['cpu']}, {v['cores']} cores; python {v['python']}, torch {v['torch']}",
        f"step: ViT depth {args.step_depth} width {args.step_width}, batch "
        f"{args.step_batch}, 1 intra-op thread; loader: {args.workers} worker(s), "
        f"batch {args.batch_size} at {args.im_size} px; {args.rounds} rounds of "
        f"{args.seconds} s per cell (medians)",
        "",
        "| recipe | mode | step ms | slowdown | over busy | step CPU ms | wait ms | "
        "voluntary switches / step | involuntary | loader img/s | batch wait ms |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in figures["rows"]:
        over = f"{row['over_busy']:.2f}x" if "over_busy" in row else "-"
        lines.append(
            f"| {row['recipe'] if row['mode'] not in NO_RECIPE else '(any)'} "
            f"| {row['mode']} "
            f"| {row['step_ms']:.2f} | {row['slowdown']:.2f}x | {over} "
            f"| {row['step_cpu_ms']:.2f} "
            f"| {row['step_ms'] - row['step_cpu_ms']:.2f} | {row['voluntary']:.1f} "
            f"| {row['involuntary']:.1f} | "
            + (f"{row['img_per_s']:.0f} |" if row["img_per_s"] else "- |")
            + f" {row['next_ms']:.2f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
