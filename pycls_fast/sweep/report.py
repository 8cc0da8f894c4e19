"""The analysis page of a sweep: ROOT_DIR/NAME/analysis/index.html, one
self-contained file (figures embedded as PNG data, no downloads) with a table of the
runs that sorts by any column on a click.

    analyze_sweep(sweep)   # reads sweep.json, writes the figures and index.html
"""

import base64
import html
import os
from collections.abc import Mapping, Sequence
from typing import Any

from yacs.config import CfgNode

from pycls_fast.sweep import analysis
from pycls_fast.sweep.collect import load_sweep_data
from pycls_fast.sweep.config import sweep_dir
from pycls_fast.sweep.runs import LAUNCH_LOG
from pycls_fast.sweep.samplers import is_log_scale

ANALYSIS_DIR = "analysis"

_STYLE = """
body { font-family: sans-serif; margin: 24px; color: #222; }
table { border-collapse: collapse; font-size: 13px; }
th, td { border: 1px solid #ccc; padding: 3px 8px; text-align: right; }
th { background: #eee; cursor: pointer; user-select: none; }
th.asc::after { content: " \\25B2"; } th.desc::after { content: " \\25BC"; }
td.text { text-align: left; } tr.failed { background: #fde8e8; }
tr.best { background: #e6f5e6; } img { max-width: 100%; border: 1px solid #ddd; }
pre { background: #f6f6f6; padding: 8px; font-size: 12px; }
"""

# Click a header: sort by that column (numbers by data-v), again: the other way.
_SORT_JS = """
document.querySelectorAll("table.runs th").forEach((th, col) => {
  th.addEventListener("click", () => {
    const body = th.closest("table").tBodies[0];
    const up = !th.classList.contains("asc");
    th.parentNode.querySelectorAll("th")
      .forEach(h => h.classList.remove("asc", "desc"));
    th.classList.add(up ? "asc" : "desc");
    const key = r => { const c = r.cells[col]; const v = c.dataset.v;
      return v !== undefined && v !== "" ? parseFloat(v) : c.textContent; };
    const rows = Array.from(body.rows).sort((a, b) => {
      const x = key(a), y = key(b);
      const d = (typeof x === "number" && typeof y === "number") ? x - y
        : String(x).localeCompare(String(y));
      return up ? d : -d; });
    rows.forEach(r => body.appendChild(r));
  });
});
"""


def _cell(value: Any, fmt: str = "{}") -> str:
    if value is None:
        return '<td data-v="">-</td>'
    if isinstance(value, int | float) and not isinstance(value, bool):
        return f'<td data-v="{value}">{fmt.format(value)}</td>'
    return f'<td class="text">{html.escape(str(value))}</td>'


def _row(
    run: Mapping[str, Any], keys: Sequence[str], best: str | None, base: str
) -> str:
    s, cx = run["summary"], run["complexity"]
    log = os.path.join(run["out_dir"], "stdout.log")
    if not os.path.isfile(log):  # failed before logging: its process's output
        log = os.path.join(run["out_dir"], LAUNCH_LOG)
    log = os.path.relpath(log, base)
    link = f'<td class="text"><a href="{html.escape(log)}">{run["name"]}</a></td>'
    cells = [link, _cell(run["status"])]
    cells += [_cell(analysis.key_value(run, k)) for k in keys]
    cells += [
        _cell(cx["flops"] / 1e6, "{:.2f}"),
        _cell(cx["params"] / 1e6, "{:.3f}"),
        _cell(s["time_epoch_s"], "{:.1f}"),
        _cell(s["epochs_done"], "{}/" + str(s["epochs_total"] or "?")),
        _cell(s["top1_err"], "{:.2f}"),
        _cell(s["min_top1_err"], "{:.2f}"),
        _cell(run["error"] or ""),
    ]
    klass = "best" if run["name"] == best else run["status"]
    return f'<tr class="{klass}">' + "".join(cells) + "</tr>"


def runs_table(
    runs: Sequence[Mapping[str, Any]], keys: Sequence[str], base: str = "."
) -> str:
    """The sortable HTML table of the runs (one row each; the best done run is green),
    linking each run's log relative to the folder `base`."""
    best = analysis.best_name(runs)
    heads = ["run", "status", *keys, "flops (M)", "params (M)", "epoch time (s)",
             "epochs", "top-1 err (%)", "best top-1 err (%)", "error"]  # fmt: skip
    head = "".join(f"<th>{html.escape(h)}</th>" for h in heads)
    body = "\n".join(_row(r, keys, best, base) for r in runs)
    return (
        f'<table class="runs"><thead><tr>{head}</tr></thead>\n'
        f"<tbody>\n{body}\n</tbody></table>"
    )


def _image(path: str) -> str:
    with open(path, "rb") as f:
        data = base64.b64encode(f.read()).decode()
    name = html.escape(os.path.basename(path))
    return (
        f'<p><img alt="{name}" title="{name}" src="data:image/png;base64,{data}"></p>'
    )


def write_page(
    data: Mapping[str, Any],
    figures: Sequence[str],
    keys: Sequence[str],
    sweep_cfg_text: str,
    path: str,
) -> str:
    """Writes the analysis page at `path`; returns it."""
    counts = ", ".join(f"{n} {status}" for status, n in sorted(data["counts"].items()))
    title = html.escape(f"sweep {data['name']}")
    parts = [
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{title}</title>",
        f"<style>{_STYLE}</style></head><body>",
        f"<h1>{title}</h1>",
        f"<p>{html.escape(data.get('desc') or '')}</p>",
        f"<p>{len(data['runs'])} runs: {html.escape(counts)}. "
        "Click a column's name to sort by it.</p>",
        "<h2>Runs</h2>",
        runs_table(data["runs"], keys, os.path.dirname(os.path.abspath(path))),
        "<h2>Figures</h2>",
        *(_image(p) for p in figures),
        "<h2>Sweep config</h2>",
        f"<pre>{html.escape(sweep_cfg_text)}</pre>",
        f"<script>{_SORT_JS}</script></body></html>",
    ]
    with open(path, "w") as f:
        f.write("\n".join(parts))
    return path


def analyze_sweep(sweep: CfgNode) -> str:
    """Writes the figures and index.html of a collected sweep into
    ROOT_DIR/NAME/analysis/; returns the page's path."""
    data = load_sweep_data(sweep)
    out_dir = os.path.join(sweep_dir(sweep), ANALYSIS_DIR)
    keys = list(data["swept_keys"])
    keys += [k for k in sweep.ANALYZE.METRICS if k not in keys]
    log_keys = {k for k, s in sweep.SETUP.SAMPLERS.items() if is_log_scale(s)}
    figures = analysis.plot_sweep(
        data, out_dir, keys, log_keys, sweep.ANALYZE.PLOT_CURVES_BEST
    )
    with open(sweep.SWEEP_CFG_FILE) as f:
        text = f.read()
    return write_page(data, figures, keys, text, os.path.join(out_dir, "index.html"))
