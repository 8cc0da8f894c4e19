"""Training curves from json_stats logs: what `tools/plot_log.py` draws.

    runs = {name: read_run(path) for path in paths}   # a run folder or its log file
    plot_runs(runs, "plots.png")

A run's curves are per epoch: train and test loss, top-1 and top-5 errors (test and
EMA test), the learning rate and the training images/s. Where a run resumed from a
checkpoint, each panel gets a dotted vertical line at that point. An epoch logged
more than once (a rerun from scratch, a resume from an older checkpoint) is drawn
once, from its last record.
"""

import os
import re
from dataclasses import dataclass, field

from pycls_fast.errors import UserError
from pycls_fast.observe.logging import LOG_FILE, last_per_epoch, load_json_stats

# The trainer's line when it resumes: "resumed from PATH (epoch E, iteration I)";
# PATH may hold spaces (an OUT_DIR with a space).
_RESUMED = re.compile(r"resumed from .+ \(epoch (\d+), iteration (\d+)\)")


@dataclass
class Run:
    """One run's json_stats records and where it resumed (in epochs, e.g. 2.5)."""

    name: str
    log: str
    records: list[dict]
    resumes: list[float] = field(default_factory=list)


def log_path(path: str) -> str:
    """The log of a run: `path` itself when it is a file, else path/stdout.log."""
    return path if os.path.isfile(path) else os.path.join(path, LOG_FILE)


def run_name(path: str) -> str:
    """A run's name: its folder's name (the folder holding the log file)."""
    folder = os.path.dirname(path) if os.path.isfile(path) else path
    return os.path.basename(os.path.normpath(os.path.abspath(folder)))


def epoch_number(value: str | int) -> int:
    """pycls writes epochs as '3/100'; returns 3 (an int stays as it is)."""
    return int(str(value).split("/")[0])


def _iters_per_epoch(records: list[dict]) -> int | None:
    for r in records:
        if r.get("_type") == "train_iter" and "/" in str(r.get("iter", "")):
            return int(str(r["iter"]).split("/")[1])
    return None


def resume_points(log: str, records: list[dict]) -> list[float]:
    """Where the run resumed, in epochs done (epoch 3, iteration 40 of 80: 2.5)."""
    iters = _iters_per_epoch(records)
    points = []
    with open(log) as f:
        for line in f:
            m = _RESUMED.search(line)
            if m:
                epoch, iteration = int(m.group(1)), int(m.group(2))
                points.append(epoch - 1 + (iteration / iters if iters else 0.0))
    return points


def read_run(path: str) -> Run:
    """Reads a run from its folder or its log file; UserError when there is no log
    or it holds no train_epoch record yet."""
    log = log_path(path)
    if not os.path.isfile(log):
        raise UserError(f"no log in {path}: {log} not found")
    records = load_json_stats(log)
    if not any(r.get("_type") == "train_epoch" for r in records):
        raise UserError(f"{log} has no train_epoch records yet")
    return Run(run_name(path), log, records, resume_points(log, records))


_EPOCH_TYPES = ("train_epoch", "test_epoch", "test_ema_epoch")


def curves(records: list[dict]) -> dict[str, tuple[list[int], list[float]]]:
    """{name: (epochs, values)} of the curves in a run's json_stats records: one
    point per epoch, its last record's (a rerun's epochs replace the earlier ones)."""
    records = last_per_epoch(r for r in records if r.get("_type") in _EPOCH_TYPES)
    kinds = {
        "train": [r for r in records if r.get("_type") == "train_epoch"],
        "test": [r for r in records if r.get("_type") == "test_epoch"],
        "test (EMA)": [r for r in records if r.get("_type") == "test_ema_epoch"],
    }

    def series(rows, key):
        rows = [r for r in rows if key in r]
        return [epoch_number(r["epoch"]) for r in rows], [r[key] for r in rows]

    out = {}
    for kind, rows in kinds.items():
        if not rows:
            continue
        out[f"{kind} loss"] = series(rows, "loss")
        out[f"{kind} top-1 err"] = series(rows, "top1_err")
        out[f"{kind} top-5 err"] = series(rows, "top5_err")
    train = kinds["train"]
    out["lr"] = series(train, "lr")
    out["train img/s"] = series(train, "img_per_s")
    return {name: xy for name, xy in out.items() if xy[0]}


# (row, column, y-axis label, curve names)
PANELS = [
    (0, 0, "loss", ["train loss", "test loss", "test (EMA) loss"]),
    (0, 1, "top-1 error (%)", ["train top-1 err", "test top-1 err",
                               "test (EMA) top-1 err"]),
    (0, 2, "top-5 error (%)", ["train top-5 err", "test top-5 err",
                               "test (EMA) top-5 err"]),
    (1, 0, "learning rate", ["lr"]),
    (1, 1, "train images / s", ["train img/s"]),
]  # fmt: skip


def _style(name: str) -> str:
    return (
        "--"
        if name.startswith("train") and "img/s" not in name
        else (":" if "EMA" in name else "-")
    )


def plot_runs(runs: list[Run], path: str) -> str:
    """Draws the runs' curves into one PNG at `path` (one colour per run); returns
    the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    axes[1][2].axis("off")
    for i, run in enumerate(runs):
        color = f"C{i}"
        data = curves(run.records)
        for row, col, _, names in PANELS:
            ax = axes[row][col]
            for name in names:
                if name in data:
                    xs, ys = data[name]
                    tag = name if len(runs) == 1 else f"{run.name}: {name}"
                    ax.plot(xs, ys, _style(name), color=color, label=tag, marker=".")
            for x in run.resumes:
                ax.axvline(x, color=color, linestyle=":", alpha=0.6)
    for row, col, ylabel, _ in PANELS:
        ax = axes[row][col]
        ax.set_xlabel("epoch")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    if any(run.resumes for run in runs):
        axes[1][2].text(
            0.0, 0.9, "dotted vertical line: resumed from a checkpoint", fontsize=9
        )
    title = runs[0].name if len(runs) == 1 else ", ".join(r.name for r in runs)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
