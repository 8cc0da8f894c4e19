#!/usr/bin/env python3
"""Plots training curves from json_stats logs: loss, top-1 error, lr and img/s.

    python tools/plot_log.py OUT_DIR [OUT_DIR ...] [--out FILE.png]

With one run the figure goes to OUT_DIR/plots.png; with several runs they are
overlaid (one colour each, labelled by folder) and the figure goes to --out
(default: plots.png in the current folder).
"""

import argparse
import os

from pycls_fast.core.cli import run
from pycls_fast.core.logging import LOG_FILE, load_json_stats
from pycls_fast.errors import UserError


def epoch_number(value):
    """pycls writes epochs as '3/100'; returns 3 (an int stays as it is)."""
    return int(str(value).split("/")[0])


def curves(records):
    """Returns {name: (xs, ys)} of the curves in a run's json_stats records."""
    train = [r for r in records if r.get("_type") == "train_epoch"]
    test = [r for r in records if r.get("_type") == "test_epoch"]
    ema = [r for r in records if r.get("_type") == "test_ema_epoch"]

    def series(rows, key):
        return [epoch_number(r["epoch"]) for r in rows], [r[key] for r in rows]

    out = {
        "train loss": series(train, "loss"),
        "train top-1 err": series(train, "top1_err"),
        "test top-1 err": series(test, "top1_err"),
        "lr": series(train, "lr"),
        "train img/s": series(train, "img_per_s"),
    }
    if ema:
        out["test top-1 err (EMA)"] = series(ema, "top1_err")
    return out


def plot_runs(runs, path):
    """Draws the runs' curves into one PNG at `path`; runs: {label: records}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    panels = [
        (axes[0][0], "loss", ["train loss"]),
        (axes[0][1], "top-1 error (%)", ["train top-1 err", "test top-1 err",
                                          "test top-1 err (EMA)"]),
        (axes[1][0], "learning rate", ["lr"]),
        (axes[1][1], "train images / s", ["train img/s"]),
    ]  # fmt: skip
    styles = {
        "test top-1 err": "-",
        "test top-1 err (EMA)": ":",
        "train top-1 err": "--",
    }
    for i, (label, records) in enumerate(runs.items()):
        color = f"C{i}"
        data = curves(records)
        for ax, _, names in panels:
            for name in names:
                if name in data and data[name][0]:
                    xs, ys = data[name]
                    tag = name if len(runs) == 1 else f"{label}: {name}"
                    ax.plot(xs, ys, styles.get(name, "-"), color=color, label=tag)
    for ax, title, _ in panels:
        ax.set_title(title)
        ax.set_xlabel("epoch")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dirs", nargs="+", help="run folders (OUT_DIR)")
    parser.add_argument("--out", help="PNG to write")
    args = parser.parse_args()
    runs = {}
    for out_dir in args.out_dirs:
        log = os.path.join(out_dir, LOG_FILE)
        if not os.path.isfile(log):
            raise UserError(f"no log in {out_dir}: {log} not found")
        records = load_json_stats(log)
        if not any(r.get("_type") == "train_epoch" for r in records):
            raise UserError(f"{log} has no train_epoch records yet")
        runs[os.path.basename(os.path.normpath(out_dir))] = records
    default = (
        os.path.join(args.out_dirs[0], "plots.png") if len(runs) == 1 else "plots.png"
    )
    path = plot_runs(runs, args.out or default)
    print(f"wrote {path}")


if __name__ == "__main__":
    run(main)
