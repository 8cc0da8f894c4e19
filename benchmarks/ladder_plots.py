"""The distributed ladder's figures, in the article's form, from its JSON records.

    python -m benchmarks.ladder_plots out/ladder_8.json out/ladder_16.json ... \\
        --out-dir out/ladder

writes scaling.png (TFLOP/s per device vs device count: the DDP baseline and the
optimized rung, one point per run) and, from the run with the most devices,
ladder.png and epoch_time.png (benchmarks/ladder_dist.py writes those two itself).
"""

import argparse
import json
import os

from pycls_fast.errors import UserError
from pycls_fast.launch.cli import run


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _where(record):
    return f"{record['devices']} x {record['device']}, global batch {record['batch']}"


def _save(fig, out_dir, name):
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    fig.savefig(path, dpi=110)
    return path


def plot_ladder(record: dict, out_dir: str) -> str:
    """Bars: each rung's TFLOP/s per device over the DDP baseline's; returns the PNG."""
    plt = _pyplot()
    rows = record["rows"]
    fig, ax = plt.subplots(figsize=(max(6.5, 0.95 * len(rows) + 2), 4.4))
    colors = [
        "tab:gray" if r["name"] == record["baseline"] else "tab:blue" for r in rows
    ]
    bars = ax.bar(range(len(rows)), [r["vs_baseline"] for r in rows], color=colors)
    for bar, r in zip(bars, rows):
        ax.annotate(
            f"{r['vs_baseline']:.2f}x",
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center",
            va="bottom",
            fontsize=9,
        )
    ax.axhline(1.0, color="black", linewidth=0.6)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([r["label"] for r in rows], rotation=30, ha="right")
    ax.set_ylabel("TFLOP/s per device vs DDP fp32")
    ax.set_ylim(0, max(r["vs_baseline"] for r in rows) * 1.18)
    ax.set_title(f"Optimization ladder: {os.path.basename(record['config'])}\n"
                 f"{_where(record)}", fontsize=10)  # fmt: skip
    fig.tight_layout()
    path = _save(fig, out_dir, "ladder.png")
    plt.close(fig)
    return path


def plot_epoch_time(record: dict, out_dir: str) -> str:
    """Bars: ImageNet-1k epoch time of the baseline and of the optimized rung."""
    plt = _pyplot()
    by_name = {r["name"]: r for r in record["rows"]}
    shown = [by_name[record["baseline"]], by_name[record["optimized"]]]
    fig, ax = plt.subplots(figsize=(5.2, 4.2))
    hours = [r["epoch_hours"] for r in shown]
    bars = ax.bar([0, 1], hours, color=["tab:gray", "tab:blue"], width=0.55)
    for bar, h in zip(bars, hours):
        ax.annotate(
            f"{h:.2f} h",
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center",
            va="bottom",
        )
    ax.set_xticks([0, 1])
    ax.set_xticklabels(["DDP fp32 baseline", f"optimized\n({shown[1]['label']})"])
    ax.set_ylabel("ImageNet-1k epoch (hours)")
    ax.set_ylim(0, max(hours) * 1.2)
    ax.set_title(f"Epoch time, {_where(record)}", fontsize=10)
    fig.tight_layout()
    path = _save(fig, out_dir, "epoch_time.png")
    plt.close(fig)
    return path


def plot_scaling(records: list[dict], out_dir: str) -> str:
    """Lines: TFLOP/s per device vs device count, baseline and optimized."""
    plt = _pyplot()
    records = sorted(records, key=lambda r: r["devices"])
    fig, ax = plt.subplots(figsize=(6, 4.2))
    for which, color, label in (
        ("baseline", "tab:gray", "DDP fp32 baseline"),
        ("optimized", "tab:blue", "optimized"),
    ):
        xs, ys = [], []
        for rec in records:
            row = next(r for r in rec["rows"] if r["name"] == rec[which])
            xs.append(rec["devices"])
            ys.append(row["tflops_per_device"])
        ax.plot(xs, ys, "o-", color=color, label=label)
        for x, y in zip(xs, ys):
            ax.annotate(f"{y:.3g}", (x, y), textcoords="offset points", xytext=(0, 6),
                        ha="center", fontsize=8)  # fmt: skip
    counts = sorted({r["devices"] for r in records})
    ax.set_xscale("log", base=2)
    ax.set_xticks(counts)
    ax.set_xticklabels([str(c) for c in counts])
    ax.set_xlabel("devices")
    ax.set_ylabel("TFLOP/s per device")
    ax.set_ylim(0, None)
    ax.legend(loc="lower left")
    last = records[-1]
    ax.set_title(
        f"Scaling: {os.path.basename(last['config'])}, {last['device']}", fontsize=10
    )
    fig.tight_layout()
    path = _save(fig, out_dir, "scaling.png")
    plt.close(fig)
    return path


def load_records(paths: list[str]) -> list[dict]:
    """The JSON records of benchmarks/ladder_dist.py runs (one clear line if not)."""
    records = []
    for path in paths:
        try:
            with open(path) as f:
                record = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise UserError(f"cannot read ladder record {path}: {e}") from None
        if not {"rows", "devices", "baseline", "optimized"} <= set(record):
            raise UserError(f"{path} is not a record of benchmarks/ladder_dist.py")
        records.append(record)
    return records


def main():
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.ladder_plots",
        description="The scaling figure (and the ladder and epoch-time figures of "
        "the largest run) from ladder_dist JSON records.",
    )
    p.add_argument("records", nargs="+", help="JSON files of ladder_dist --json-out")
    p.add_argument("--out-dir", required=True, help="where the PNGs go")
    args = p.parse_args()
    records = load_records(args.records)
    largest = max(records, key=lambda r: r["devices"])
    for path in (
        plot_scaling(records, args.out_dir),
        plot_ladder(largest, args.out_dir),
        plot_epoch_time(largest, args.out_dir),
    ):
        print(f"figure: {path}")


if __name__ == "__main__":
    run(main)
