"""A real run against its step: the training loop with each loader mode and recipe.

    python -m benchmarks.real_run --cfg configs/vit/ViT-B-16.yaml --data DIR \\
        --amp O3,O1 --modes threads,subprocess,processes --recipes pycls,deit \\
        --steps 200 --out out/bench/real_run [KEY VALUE ...]

For each AMP mode (one model built once): the step alone on a synthetic batch (as
`time_net` times it: `step img/s`), then, per (recipe, loader mode) cell, the real
loop (`train_epoch`: the device prefetcher, meters, EMA, logging) over a real loader
of --data's train split with the recipe's train transforms (benchmarks/contention.py's
RECIPES; 'cfg': the --cfg file's own; 'deit+device': DeiT's with
TRAIN.AUGMENT_BACKEND device), for --warmup steps and then --steps timed
ones: `real img/s` and `real / step`. Per cell also: the loader's data-wait
fraction, and the training thread's CPU time per step and voluntary context
switches per step (GIL waits).
`--extra-cells RECIPE:MODE,...` adds those cells at the first AMP mode (e.g.
`deit+device:subprocess`), `--graphs-cell RECIPE:MODE` one with TRAIN.CUDA_GRAPHS
True. The slowest cell is then rerun for --profile-steps steps under torch.profiler:
a trace (chrome JSON) and its operator table in --out.

The table goes to stdout and --out/real_run.md, the figures to --out/real_run.json.
On a CPU it runs as written (tests/integration/test_bench_real_run.py, tiny); the
figures that matter are a GPU's (benchmarks/gpu_node.sh).
"""

import argparse
import json
import os
import statistics
import time

import numpy as np
import torch

from benchmarks.contention import RECIPE_KEYS, RECIPES

MODES = ("threads", "spdl", "subprocess", "processes")


def _parser():
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.real_run", description=__doc__.split("\n")[0]
    )
    p.add_argument("--cfg", required=True)
    p.add_argument("--data", required=True, help="ImageNet-layout root (train split)")
    p.add_argument("--amp", default="O3", help="AMP modes, comma-separated")
    p.add_argument("--modes", default="threads,subprocess,processes")
    p.add_argument("--recipes", default="pycls,deit",
                   help=",".join([*RECIPES, "cfg"]) + "; RECIPE+device: its "
                   "TRAIN.AUGMENT on the device")  # fmt: skip
    p.add_argument("--steps", type=int, default=200, help="timed steps per cell")
    p.add_argument("--warmup", type=int, default=20, help="untimed steps first")
    p.add_argument(
        "--extra-cells",
        default="",
        help="RECIPE:MODE,... run too, at the first AMP mode",
    )
    p.add_argument("--graphs-cell", default="", help="RECIPE:MODE with CUDA graphs")
    p.add_argument("--profile-steps", type=int, default=8)
    p.add_argument("--out", default="out/bench/real_run")
    p.add_argument("opts", nargs=argparse.REMAINDER, help="KEY VALUE overrides")
    return p


def _cfg(args, amp, recipe=None, mode=None, graphs=False):
    from pycls_fast.config import load_cfg, with_overrides

    cfg = load_cfg(args.cfg, list(args.opts))
    over = {"AMP.MODE": amp, "DATA.PATH": args.data, "TRAIN.CUDA_GRAPHS": graphs}
    over["OUT_DIR"] = os.path.join(args.out, "run")
    over["DATA.INDEX_CACHE"] = False
    over["DATA_LOADER.MAX_BAD_FRAC"] = 0.5  # speed is measured here, not data
    if recipe not in (None, "cfg"):  # 'cfg': the --cfg file's own transforms
        name, _, backend = recipe.partition("+")  # 'deit+device': its policy there
        source = load_cfg(RECIPES[name])
        over |= {k: source[k.split(".")[0]][k.split(".")[1]] for k in RECIPE_KEYS}
        if backend:
            over["TRAIN.AUGMENT_BACKEND"] = backend
    if mode is not None:
        over["DATA_LOADER.MODE"] = mode
    return with_overrides(cfg, over)


def _switches():
    with open("/proc/thread-self/status") as f:
        fields = dict(ln.split(":", 1) for ln in f if "ctxt_switches" in ln)
    return int(fields["voluntary_ctxt_switches"])


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_img_per_s(parts, steps):
    """img/s of the step alone on a synthetic batch (median of `steps` steps)."""
    from pycls_fast.engine.timing import time_train

    batch = parts.cfg.TRAIN.BATCH_SIZE
    timed = time_train(parts, batch, warmup=3, iters=max(3, steps // 10))
    return batch / timed["step_s"]


def real_loop(parts, cfg, args, profile_dir=None):
    """The figures of `train_epoch` over a loader of `cfg`, on `parts`' model."""
    from pycls_fast.datasets.loader import construct_train_loader
    from pycls_fast.datasets.to_device.prefetch import DevicePrefetcher
    from pycls_fast.datasets.to_device.transform import DeviceBatchTransform
    from pycls_fast.engine.trainer import train_epoch

    loader = construct_train_loader(cfg, 0, 1)
    batch = cfg.TRAIN.BATCH_SIZE
    n = len(loader.decoder.index)
    steps = args.warmup + (args.profile_steps if profile_dir else args.steps)
    # A fixed plan of `steps` batches over the images (repeated as needed): one
    # epoch as long as the cell, without an epoch boundary in the timed part.
    order = np.concatenate(
        [np.random.default_rng(k).permutation(n) for k in range(-(-steps * batch // n))]
    )
    plan = [order[k * batch : (k + 1) * batch] for k in range(steps)]
    loader = loader.with_plan(plan)
    parts.train_loader = loader
    prep = parts.train_prep
    if cfg.TRAIN.AUGMENT_BACKEND == "device":  # the cell's policy on the device
        prep = DeviceBatchTransform(cfg, prep.device, prep.dtype, True)
    parts.train_batches = DevicePrefetcher(loader, prep)
    marks = {}

    def on_iter_end(epoch, done, iters):
        if done == args.warmup:
            _sync(parts.device)
            marks["start"] = time.perf_counter(), time.thread_time(), _switches()
            if profile_dir:
                marks["profiler"] = _start_profiler(parts.device)
        elif done == iters:
            _sync(parts.device)
            marks["end"] = time.perf_counter(), time.thread_time(), _switches()
            if profile_dir:
                _save_profile(marks.pop("profiler"), profile_dir)

    try:
        record = train_epoch(parts, 0, on_iter_end=on_iter_end)
    finally:
        loader.close()
    (t0, c0, v0), (t1, c1, v1) = marks["start"], marks["end"]
    timed = steps - args.warmup
    return {
        "real_img_per_s": timed * batch / (t1 - t0),
        "thread_cpu_ms_per_step": 1e3 * (c1 - c0) / timed,
        "wall_ms_per_step": 1e3 * (t1 - t0) / timed,
        "voluntary_switches_per_step": (v1 - v0) / timed,
        "data_wait_frac": record["data_wait_frac"],
    }


def _start_profiler(device):
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    prof = torch.profiler.profile(activities=activities)
    prof.__enter__()
    return prof


def _save_profile(prof, out_dir):
    prof.__exit__(None, None, None)
    os.makedirs(out_dir, exist_ok=True)
    prof.export_chrome_trace(os.path.join(out_dir, "trace.json"))
    sort = (
        "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    )
    table = prof.key_averages().table(sort_by=sort, row_limit=30)
    with open(os.path.join(out_dir, "operators.txt"), "w") as f:
        f.write(table)


def main():
    from pycls_fast.engine.trainer import build_components, seed_everything
    from pycls_fast.launch.cli import run

    args = _parser().parse_args()

    def body():
        rows, slowest = [], None
        cells = [
            (amp, recipe, mode, False)
            for amp in args.amp.split(",")
            for recipe in args.recipes.split(",")
            for mode in args.modes.split(",")
        ]
        first_amp = args.amp.split(",")[0]
        for cell in filter(None, args.extra_cells.split(",")):
            recipe, mode = cell.split(":")
            cells.append((first_amp, recipe, mode, False))
        if args.graphs_cell:
            recipe, mode = args.graphs_cell.split(":")
            cells.append((first_amp, recipe, mode, True))
        built = {}
        for amp, recipe, mode, graphs in cells:
            if (amp, graphs) not in built:
                built.clear()  # one model on the device at a time
                seed_everything(0)
                cfg = _cfg(args, amp, graphs=graphs)
                parts = build_components(cfg, loaders=("train",))
                parts.train_loader.close()
                step = step_img_per_s(parts, args.steps)
                built[amp, graphs] = parts, step
                print(f"{amp}{' graphs' if graphs else ''}: step {step:.0f} img/s",
                      flush=True)  # fmt: skip
            parts, step = built[amp, graphs]
            cfg = _cfg(args, amp, recipe, mode, graphs)
            figures = real_loop(parts, cfg, args)
            row = {"amp": amp, "recipe": recipe, "mode": mode, "cuda_graphs": graphs,
                   "step_img_per_s": step, **figures,
                   "real_over_step": figures["real_img_per_s"] / step}  # fmt: skip
            rows.append(row)
            print(_row(row), flush=True)
            if slowest is None or row["real_over_step"] < slowest[0]["real_over_step"]:
                slowest = (row, cfg)
        profile = None
        if slowest is not None and args.profile_steps > 0:
            row, cfg = slowest
            parts, _ = built.get((row["amp"], row["cuda_graphs"]), (None, None))
            if parts is None:
                built.clear()
                seed_everything(0)
                base = _cfg(args, row["amp"], graphs=row["cuda_graphs"])
                parts = build_components(base, loaders=("train",))
                parts.train_loader.close()
            profile = os.path.join(args.out, "profile")
            real_loop(parts, cfg, args, profile_dir=profile)
            print(f"profile of the slowest cell ({row['amp']}, {row['recipe']}, "
                  f"{row['mode']}): {profile}/trace.json, operators.txt")  # fmt: skip
        _write(args, rows, profile)

    run(body)


HEADER = (
    "| AMP | recipe | loader | CUDA graphs | step img/s | real img/s | real / step "
    "| data wait | train thread CPU ms / step | wall ms / step | voluntary switches "
    "/ step |\n|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|"
)


def _row(r):
    return (
        f"| {r['amp']} | {r['recipe']} | {r['mode']} "
        f"| {'yes' if r['cuda_graphs'] else ''} "
        f"| {r['step_img_per_s']:.0f} | {r['real_img_per_s']:.0f} "
        f"| {r['real_over_step']:.2f} | {r['data_wait_frac']:.1%} "
        f"| {r['thread_cpu_ms_per_step']:.1f} | {r['wall_ms_per_step']:.1f} "
        f"| {r['voluntary_switches_per_step']:.1f} |"
    )


def _write(args, rows, profile):
    device = (
        torch.cuda.get_device_name()
        if torch.cuda.is_available()
        else f"CPU ({os.cpu_count()} cores)"
    )
    lines = [
        f"{args.cfg}, {device}, torch {torch.__version__}; {args.warmup} warm-up "
        f"steps, {args.steps} timed steps per cell",
        "",
        HEADER,
        *(_row(r) for r in rows),
    ]
    table = "\n".join(lines)
    print(table)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "real_run.md"), "w") as f:
        f.write(table + "\n")
    with open(os.path.join(args.out, "real_run.json"), "w") as f:
        json.dump({"device": device, "rows": rows, "profile": profile}, f, indent=1)
    # The median over cells, for a one-line summary in logs.
    if rows:
        ratio = statistics.median(r["real_over_step"] for r in rows)
        print(f"median real / step over {len(rows)} cells: {ratio:.2f}")


if __name__ == "__main__":
    main()
