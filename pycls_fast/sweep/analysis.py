"""Figures of a collected sweep (PNG, matplotlib), read from sweep.json's runs:

    error_vs_complexity.png   final test top-1 error vs flops, params, epoch time
    error_vs_keys.png         error vs each swept key (log axis for log samplers)
    curves_best.png           test top-1 error and train loss per epoch, best N runs
    error_edf.png             the error's empirical distribution (pycls's EDF)

The error of a run is its final test top-1 error; runs without a test record yet are
left out of the figures (the analysis page's table lists every run). Only finished
(done) runs rank: the best run (starred) and the best N runs' curves are done ones.
"""

import math
import os
import textwrap
from collections.abc import Mapping, Sequence
from typing import Any

from matplotlib.ticker import MaxNLocator

from pycls_fast.observe.plots import epoch_number


def error(run: Mapping[str, Any]) -> float | None:
    """The run's final test top-1 error (%), None before its first test."""
    return run["summary"]["top1_err"]


def key_value(run: Mapping[str, Any], key: str) -> Any:
    """A config key's value in a run: its swept value, or the fork's config's."""
    if key in run["overrides"]:
        return run["overrides"][key]
    node: Any = run["cfg"]
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def with_error(runs: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The runs with a test error (finished or not), lowest error first."""
    return sorted((r for r in runs if error(r) is not None), key=error)


def ranked(runs: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The finished (done) runs, best (lowest final error) first: a failed or
    unfinished run's error is not final, so it never ranks, however low it is."""
    return [r for r in with_error(runs) if r.get("status") == "done"]


def best_name(runs: Sequence[Mapping[str, Any]]) -> str | None:
    """The name of the sweep's best finished run, None before one finishes."""
    done = ranked(runs)
    return done[0]["name"] if done else None


def label(run: Mapping[str, Any]) -> str:
    """'000003: OPTIM.BASE_LR=0.003, VIT.NUM_LAYERS=4' (keys shortened to leaves)."""
    values = ", ".join(f"{k.split('.')[-1]}={v}" for k, v in run["overrides"].items())
    return f"{run['name']}: {values}"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _scatter(ax, xs, ys, names, best_name, log=False):
    ax.scatter(xs, ys, s=36, color="C0", alpha=0.8, zorder=3)
    seen: dict[float, int] = {}
    for x, y, name in zip(xs, ys, names, strict=True):
        if name == best_name:
            ax.scatter([x], [y], s=160, marker="*", color="C3", zorder=4)
        if len(names) <= 24:
            # Points sharing an x (a grid): alternate their labels above and below.
            side = seen[x] = seen.get(x, -1) + 1
            dy = 2 if side % 2 == 0 else -9
            ax.annotate(name[-3:], (x, y), fontsize=7, xytext=(4, dy),
                        textcoords="offset points")  # fmt: skip
    if 1 < len(set(xs)) < len(xs):
        # Repeated x values (a grid): the best error at each, as a trend line.
        best = {x: min(y for x2, y in zip(xs, ys, strict=True) if x2 == x) for x in xs}
        ax.plot(*zip(*sorted(best.items()), strict=True), "--", color="0.5", lw=1)
    if log:
        ax.set_xscale("log")
    elif all(isinstance(x, int) for x in xs):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.set_ylabel("test top-1 error (%)")


def _numeric(values: Sequence[Any]) -> bool:
    return all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)


def plot_error_vs(
    runs: Sequence[Mapping[str, Any]],
    panels: Sequence[tuple[str, Any, bool]],
    path: str,
    title: str,
) -> str:
    """One scatter panel per (x label, run -> x value, log x axis) against the error;
    categorical x values (strings, lists) are spread on a shared ordered axis."""
    plt = _pyplot()
    done = with_error(runs)
    cols = min(3, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 4 * rows), squeeze=False)
    best = best_name(runs)
    for ax, (xlabel, get, log) in zip(axes.flat, panels, strict=False):
        xs = [get(r) for r in done]
        names = [r["name"] for r in done]
        ys = [error(r) for r in done]
        if not _numeric(xs):
            ticks = sorted({str(x) for x in xs})
            ax.set_xticks(range(len(ticks)), ticks, rotation=20, fontsize=8)
            xs = [ticks.index(str(x)) for x in xs]
            log = False
        _scatter(ax, xs, ys, names, best, log)
        ax.set_xlabel(xlabel)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    legend = "numbers: run; red star: best done run; dashed: best error at each value"
    fig.suptitle(
        fit_width(f"{title}: {len(done)} runs with a test error ({legend})", fig)
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def fit_width(text: str, fig, fontsize: float = 14.4) -> str:
    """`text` wrapped into lines that fit the figure's width (a suptitle wider than
    its figure is cut off at both sides): about 0.6 em per character."""
    chars = int(fig.get_figwidth() * 72 / (0.6 * fontsize))
    return textwrap.fill(text, max(chars, 20))


def complexity_panels() -> list[tuple[str, Any, bool]]:
    """Panels of error vs flops (M), params (M) and mean train epoch time (s)."""
    return [
        ("flops (M, multiply-adds per image)",
         lambda r: r["complexity"]["flops"] / 1e6, False),
        ("params (M)", lambda r: r["complexity"]["params"] / 1e6, False),
        ("train epoch time (s, mean)", lambda r: r["summary"]["time_epoch_s"], False),
    ]  # fmt: skip


def key_panels(keys: Sequence[str], log_keys: set[str]) -> list[tuple[str, Any, bool]]:
    """Panels of error vs each config key."""
    return [(k, lambda r, k=k: key_value(r, k), k in log_keys) for k in keys]


def plot_curves(runs: Sequence[Mapping[str, Any]], n: int, path: str) -> str:
    """Test top-1 error and train loss per epoch of the best `n` finished runs."""
    plt = _pyplot()
    best = ranked(runs)[:n]
    fig, (ax_err, ax_loss) = plt.subplots(1, 2, figsize=(13, 4.5))
    for i, run in enumerate(best):
        stats = run["json_stats"]
        for ax, kind, key in ((ax_err, "test_epoch", "top1_err"),
                              (ax_loss, "train_epoch", "loss")):  # fmt: skip
            rows = stats.get(kind, [])
            xs = [epoch_number(r["epoch"]) for r in rows]
            ax.plot(xs, [r[key] for r in rows], "-o", ms=3, color=f"C{i}",
                    label=label(run))  # fmt: skip
    ax_err.set_ylabel("test top-1 error (%)")
    ax_loss.set_ylabel("train loss")
    for ax in (ax_err, ax_loss):
        ax.set_xlabel("epoch")
        ax.grid(alpha=0.3)
    if best:
        ax_err.legend(fontsize=8)
    fig.suptitle(f"training curves of the best {len(best)} runs")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_edf(runs: Sequence[Mapping[str, Any]], path: str) -> str:
    """The fraction of runs with an error below e, against e (pycls's EDF)."""
    plt = _pyplot()
    errors = [error(r) for r in with_error(runs)]
    fig, ax = plt.subplots(figsize=(5.5, 4))
    if errors:
        fractions = [(i + 1) / len(errors) for i in range(len(errors))]
        ax.step(errors, fractions, where="post", color="C0")
        ax.plot(errors, fractions, "o", ms=3, color="C0")
    ax.set_xlabel("test top-1 error (%)")
    ax.set_ylabel("fraction of runs with error <= e")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.set_title(f"error EDF ({len(errors)} runs)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_sweep(
    data: Mapping[str, Any],
    out_dir: str,
    keys: Sequence[str],
    log_keys: set[str],
    curves_best: int,
) -> list[str]:
    """Writes the sweep's figures into `out_dir`; returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    runs = data["runs"]
    paths = [
        plot_error_vs(runs, complexity_panels(),
                      os.path.join(out_dir, "error_vs_complexity.png"),
                      "error vs complexity"),
    ]  # fmt: skip
    if keys:
        paths.append(
            plot_error_vs(
                runs,
                key_panels(keys, log_keys),
                os.path.join(out_dir, "error_vs_keys.png"),
                "error vs swept keys",
            )  # fmt: skip
        )
    if curves_best > 0:
        paths.append(
            plot_curves(runs, curves_best, os.path.join(out_dir, "curves_best.png"))
        )
    paths.append(plot_edf(runs, os.path.join(out_dir, "error_edf.png")))
    return paths
