"""The optimization ladder: training images/s of one model, one optimization at a time.

    python -m benchmarks.ladder --cfg configs/pycls/ViT-P-4GF.yaml [--batch 32]
        [--rounds 3] [--iters 2] [--steps baseline,amp,...] [--peers timm,...]
        [--plot FILE] [--json] [KEY VALUE ...]

Each rung adds one optimization to the one before it (the model's dimensions stay
those of --cfg; batch --batch, one process):

  baseline      fp32, class token, batch-first, per-parameter optimizer loop
  amp           + AMP O1 (autocast to AMP.DTYPE, fp32 weights)
  mta           + multi-tensor-apply optimizer (OPTIM.MTA)
  pooled        + pooled classifier (VIT.CLASSIFIER_TYPE pooled)
  batch_second  + batch-second token layout (VIT.LAYOUT batch_second)
  amp_o2        + AMP O2 (half-precision weights, fp32 master weights)
  compile       + torch.compile (TRAIN.COMPILE model)
  loader        + the threaded loader feeding photo-like JPEGs (train transforms and
                  device-side batch preparation of --cfg), instead of a synthetic
                  batch; compiled when the compile rung ran

Peers, at the precision, optimizer and batch of the last synthetic rung: timm's
VisionTransformer with the same dimensions (pooled: global_pool='avg',
class_token=False), eager ('timm') and compiled ('timm_compile').

Every variant is built first, then all are timed side by side: `--rounds` rounds of
`--iters` training steps each (A, B, C, ..., A, B, C, ...), medians reported. The table
gives images/s, the ratio to the first rung, the achieved model FLOP/s and the MFU
against the matmul peak of this device and the variant's dtype, measured in the same
run. A bar chart of the speed-ups is written to --plot.
"""

import argparse
import json
import os
import platform
import statistics
import tempfile

import torch

from benchmarks.harness import interleave
from pycls_fast.components.precision import apply_backend_flags, fp32_math, input_dtype
from pycls_fast.config import load_cfg, with_overrides
from pycls_fast.datasets.loader import construct_train_loader
from pycls_fast.datasets.to_device.transform import DeviceBatchTransform
from pycls_fast.engine import timing
from pycls_fast.engine.trainer import (
    build_components,
    seed_everything,
    train_step,
)
from pycls_fast.errors import UserError
from pycls_fast.launch.cli import run
from pycls_fast.models import complexity
from pycls_fast.models.timm_compat import build_timm_vit
from pycls_fast.runtime import distributed

# (name, label, config overrides added by this rung); each rung keeps the ones before.
BASELINE = [
    "AMP.MODE", "fp32",
    "TRAIN.MIXED_PRECISION", "False",
    "OPTIM.MTA", "False",
    "VIT.CLASSIFIER_TYPE", "token",
    "VIT.LAYOUT", "batch_first",
]  # fmt: skip
LADDER = [
    ("baseline", "fp32 baseline", BASELINE),
    ("amp", "+ AMP O1", ["AMP.MODE", "O1"]),
    ("mta", "+ MTA optimizer", ["OPTIM.MTA", "True"]),
    ("pooled", "+ pooled classifier", ["VIT.CLASSIFIER_TYPE", "pooled"]),
    ("batch_second", "+ batch-second", ["VIT.LAYOUT", "batch_second"]),
    ("amp_o2", "+ AMP O2", ["AMP.MODE", "O2"]),
    ("compile", "+ torch.compile", ["TRAIN.COMPILE", "model"]),
    ("loader", "+ threaded loader", []),
]
PEERS = {"timm": "timm ViT, eager", "timm_compile": "timm ViT, compiled"}


def _parser():
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.ladder",
        description="Training images/s of the optimization ladder and its peers, "
        "interleaved, with MFU and a bar chart.",
        epilog="KEY VALUE pairs override config keys of --cfg (see docs/CONFIG.md).",
    )
    p.add_argument("--cfg", dest="cfg_file", required=True, help="config file")
    p.add_argument("--batch", type=int, default=32, help="images per step (32)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (3)")
    p.add_argument("--iters", type=int, default=2, help="timed steps per round (2)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first (1)")
    names = ",".join(name for name, _, _ in LADDER)
    p.add_argument("--steps", default=names, help=f"rungs to run ({names})")
    p.add_argument(
        "--peers", default=",".join(PEERS), help=f"peers: {','.join(PEERS)} or none"
    )
    p.add_argument(
        "--workers",
        type=int,
        default=0,
        help="loader threads of the 'loader' rung (0: DATA_LOADER.NUM_WORKERS, at "
        "most the CPU count)",
    )
    p.add_argument(
        "--max-others",
        type=float,
        default=0.2,
        help="repeat a step (up to --retries times) during which other jobs took "
        "more than this many cores (0.2)",
    )
    p.add_argument("--retries", type=int, default=3, help="repeats of a step (3)")
    p.add_argument("--plot", default="", help="bar chart PNG (default: none)")
    p.add_argument("--json", action="store_true", help="end with one JSON line")
    p.add_argument("opts", nargs="*", help="config overrides: KEY VALUE ...")
    p.parse_args = p.parse_intermixed_args
    return p


def _selection(text, known, what):
    chosen = [s for s in text.split(",") if s and s != "none"]
    unknown = [s for s in chosen if s not in known]
    if unknown:
        raise UserError(f"unknown {what} {unknown[0]!r}; known: {', '.join(known)}")
    return chosen


def rung_configs(cfg_file, opts, batch):
    """Returns [(name, label, cfg)] of every rung, each with the overrides of the rungs
    before it (rungs without overrides share the previous config)."""
    common = list(opts) + ["TRAIN.BATCH_SIZE", str(batch), "NUM_GPUS", "1"]
    out, overrides = [], []
    for name, label, extra in LADDER:
        overrides = overrides + extra
        out.append((name, label, load_cfg(cfg_file, common + overrides)))
    return out


def _compile_in_place(model):
    """torch.compile applied from outside, keeping the module (and its state-dict
    names); compilation happens at the first call."""
    model.compile()
    return model


class SyntheticStep:
    """One training step on a fixed, already normalized batch (no data loading)."""

    def __init__(self, parts, batch):
        self.parts = parts
        self.inputs, self.targets = timing.synthetic_batch(
            parts, batch, parts.cfg.TRAIN.IM_SIZE
        )

    def __call__(self):
        train_step(self.parts, self.inputs, self.targets)


class LoaderStep:
    """One training step on the next batch of the threaded loader: wait for the batch,
    prepare it on the device (normalize, mixup...), step.

    One iterator lives through the whole run. While other variants run, its bounded
    queue fills and its threads go idle; each batch taken here frees a slot that the
    threads refill while the step computes, so every timed step carries the decoding
    of one batch, as in training (the work is not hidden, only shifted by a batch).
    """

    def __init__(self, parts, loader):
        self.parts = parts
        self.prep = DeviceBatchTransform(
            parts.cfg, parts.device, input_dtype(parts.mode, parts.half_dtype)
        )
        loader.set_epoch(0)
        self.batches = iter(loader)

    def __call__(self):
        images, labels = next(self.batches)
        inputs, targets = self.prep(images, labels)
        train_step(self.parts, inputs, targets)

    def close(self):
        if hasattr(self.batches, "close"):
            self.batches.close()


def _loader_cfg(cfg, root, workers):
    threads = workers or min(cfg.DATA_LOADER.NUM_WORKERS, os.cpu_count() or 1)
    return with_overrides(
        cfg,
        {
            "DATA.PATH": root,
            "DATA.INDEX_CACHE": False,
            "DATA_LOADER.MODE": "threads",
            "DATA_LOADER.NUM_WORKERS": threads,
        },
    )


def _jpeg_folder(root, images):
    from pycls_fast.datasets.formats.synthetic import make_image_folder

    per_class = -(-images // 4)
    make_image_folder(
        root, splits=("train",), num_classes=4, images_per_class=per_class
    )


def _try_first_step(name, step, notes):
    """Runs `step` once (compiling what is compiled); on failure notes why and
    returns False, so that a variant the machine cannot run is skipped, not fatal."""
    try:
        step()
        return True
    except Exception as e:  # noqa: BLE001 - e.g. torch.compile without a compiler
        notes[name] = f"skipped: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
        print(f"  {name}: {notes[name]}", flush=True)
        return False


def build_variants(args, rungs, peers, root):
    """Returns ({name: step}, {name: (label, cfg, flops, dtype)}, notes, closers)."""
    steps, info, notes, closers = {}, {}, {}, []
    by_name = {name: (label, cfg) for name, label, cfg in rungs}
    # All optimizations: the peers' precision and optimizer (compiled or not per peer).
    last_cfg = with_overrides(rungs[-1][2], {"TRAIN.COMPILE": "off"})
    for name in args.chosen:
        label, cfg = by_name[name]
        print(f"building {name}", flush=True)
        seed_everything(cfg.RNG_SEED)
        if name == "loader" and "compile" not in steps:
            # The loader rung is compiled when the compile rung ran (compiled) before.
            cfg = with_overrides(cfg, {"TRAIN.COMPILE": "off"})
        parts = build_components(cfg, loaders=False)
        if name == "loader":
            loader = construct_train_loader(_loader_cfg(cfg, root, args.workers))
            step = LoaderStep(parts, loader)
            closers.append(step.close)
        else:
            step = SyntheticStep(parts, args.batch)
        if _try_first_step(name, step, notes):
            steps[name] = step
        flops = complexity(cfg)["flops"]
        info[name] = (label, cfg, flops, timing.compute_dtype(parts))
    for name in peers:
        print(f"building {name}", flush=True)
        seed_everything(last_cfg.RNG_SEED)
        model = build_timm_vit(last_cfg)
        parts = build_components(last_cfg, loaders=False, model=model)
        if name == "timm_compile":
            _compile_in_place(parts.trained)
        step = SyntheticStep(parts, args.batch)
        if _try_first_step(name, step, notes):
            steps[name] = step
        flops = complexity(last_cfg)["flops"]
        info[name] = (PEERS[name], last_cfg, flops, timing.compute_dtype(parts))
    return steps, info, notes, closers


def measure_peaks(dtypes, device, rounds):
    """{dtype: the best of `rounds` matmul FLOP/s measurements}: other jobs can only
    slow a measurement down, and an underestimated peak would inflate the MFU."""
    samples = {d: [] for d in dtypes}
    for _ in range(rounds):
        for d in dtypes:
            samples[d].append(timing.matmul_peak_flops(device, d, iters=5))
    return {d: max(v) for d, v in samples.items()}


def results(args, times, others, info, notes, peaks):
    """One record per variant (in ladder, then peer order)."""
    rows, base = [], None
    for name, (label, _cfg, flops, dtype) in info.items():
        row = {"name": name, "label": label, "dtype": str(dtype).replace("torch.", "")}
        if name not in times:
            rows.append({**row, "note": notes.get(name, "")})
            continue
        step_s = statistics.median(times[name])
        rate = args.batch / step_s
        base = base or rate
        achieved = timing.train_flops(flops, args.batch) / step_s
        row.update(
            img_per_s=rate,
            img_per_s_min=args.batch / max(times[name]),
            img_per_s_max=args.batch / min(times[name]),
            vs_first=rate / base,
            tflops=achieved / 1e12,
            mfu=achieved / peaks[dtype],
            other_jobs_cores=max(others[name]),
            note=notes.get(name, ""),
        )
        rows.append(row)
    return rows


def print_table(rows, peaks, args):
    print()
    print(
        f"{args.cfg_file}: batch {args.batch}, {args.rounds} rounds x {args.iters} "
        f"steps, torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{platform.processor() or platform.machine()}"
    )
    # The fp32 baseline's matmuls: TF32 tensor cores or IEEE fp32 (AMP.TF32, CUDA).
    print(f"  fp32 matmuls on CUDA: {fp32_math()} (AMP.TF32)")
    for d, f in peaks.items():
        print(f"  matmul peak {str(d).replace('torch.', '')}: {f / 1e9:.0f} GFLOP/s")
    print()
    # The last column: the most CPU other jobs took during a kept step (in cores).
    print("| variant | dtype | img/s (min-max) | vs first | TFLOP/s | MFU | others |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        if "img_per_s" not in r:
            print(f"| {r['label']} | {r['dtype']} | {r['note']} | | | | |")
            continue
        print(
            f"| {r['label']} | {r['dtype']} | {r['img_per_s']:.2f} "
            f"({r['img_per_s_min']:.2f}-{r['img_per_s_max']:.2f}) | "
            f"{r['vs_first']:.2f}x | {r['tflops']:.3f} | {100 * r['mfu']:.1f}% | "
            f"{r['other_jobs_cores']:.2f} |"
        )


def comparisons(rows):
    """Ratios the ladder exists to show: the fastest synthetic rung against the peers
    and the first rung, and the loader rung against synthetic batches."""
    rate = {r["name"]: r["img_per_s"] for r in rows if "img_per_s" in r}
    ours = [r for r in rows if r["name"] in rate and r["name"] not in PEERS]
    synthetic = [r for r in ours if r["name"] != "loader"]
    out = {}
    if synthetic:
        best = max(synthetic, key=lambda r: r["img_per_s"])
        out["ours_best"] = best["name"]
        out["ours_best_mfu"] = best["mfu"]
        out["ours_best_vs_first"] = best["vs_first"]
        for peer in PEERS:
            if peer in rate:
                out[f"ours_best_vs_{peer}"] = best["img_per_s"] / rate[peer]
        if "loader" in rate:
            out["loader_vs_synthetic"] = rate["loader"] / rate.get(
                "compile", best["img_per_s"]
            )
    return out


def plot(rows, path, title):
    """Bar chart of each variant's speed-up over the first rung."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in rows if "img_per_s" in r]
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(shown) + 2), 4.2))
    colors = ["tab:gray" if r["name"] in PEERS else "tab:blue" for r in shown]
    bars = ax.bar(range(len(shown)), [r["vs_first"] for r in shown], color=colors)
    for bar, r in zip(bars, shown):
        ax.annotate(
            f"{r['vs_first']:.2f}x\n{r['img_per_s']:.1f}/s",
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_xticks(range(len(shown)))
    ax.set_xticklabels([r["label"] for r in shown], rotation=30, ha="right")
    ax.set_ylabel("training throughput vs first rung")
    ax.set_title(title, fontsize=10)
    ax.set_ylim(0, max(r["vs_first"] for r in shown) * 1.2)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    args = _parser().parse_args()
    args.chosen = _selection(args.steps, [n for n, _, _ in LADDER], "rung")
    peers = _selection(args.peers, list(PEERS), "peer")
    for key in ("batch", "rounds", "iters"):
        if getattr(args, key) < 1:
            raise UserError(f"--{key} must be >= 1")
    if not args.chosen and not peers:
        raise UserError("nothing to run: --steps and --peers are both empty")
    rungs = rung_configs(args.cfg_file, args.opts, args.batch)
    apply_backend_flags(rungs[0][2])  # AMP.TF32, CUDNN.BENCHMARK: once per process
    device = distributed.device()  # where build_components puts the rungs
    with tempfile.TemporaryDirectory() as root:
        if "loader" in args.chosen:
            # Enough batches for every call, plus the loader's read-ahead.
            calls = args.warmup + 1 + args.rounds * args.iters
            prefetch = rungs[-1][2].DATA_LOADER.PREFETCH
            _jpeg_folder(root, args.batch * (calls + prefetch + 2))
        steps, info, notes, closers = build_variants(args, rungs, peers, root)
        if not steps:
            raise RuntimeError("no variant could run: " + "; ".join(notes.values()))
        dtypes = sorted({info[n][3] for n in steps}, key=str)
        print(f"timing {', '.join(steps)}", flush=True)
        times, others = interleave(
            steps,
            device,
            args.rounds,
            args.iters,
            args.warmup,
            max_others=args.max_others,
            retries=args.retries,
        )
        peaks = measure_peaks(dtypes, device, 5)
        for close in closers:
            close()
    rows = results(args, times, others, info, notes, peaks)
    print_table(rows, peaks, args)
    summary = comparisons(rows)
    if summary:
        print()
        for key, value in summary.items():
            shown = f"{value:.3f}" if isinstance(value, float) else value
            print(f"  {key}: {shown}")
    if args.plot:
        title = (
            f"{os.path.basename(args.cfg_file)}, batch {args.batch}, "
            f"{torch.get_num_threads()} threads, torch {torch.__version__}"
        )
        plot(rows, args.plot, title)
        print(f"  chart: {args.plot}")
    if args.json:
        record = {
            "config": args.cfg_file,
            "batch": args.batch,
            "rounds": args.rounds,
            "iters": args.iters,
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "fp32_math": fp32_math(),
            "matmul_peak_gflops": {str(d): f / 1e9 for d, f in peaks.items()},
            "rows": rows,
            **summary,
        }
        print(json.dumps(record))


if __name__ == "__main__":
    run(main)
