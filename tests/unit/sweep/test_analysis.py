"""sweep/analysis.py: the figures' titles fit their figures."""

import pytest

from pycls_fast.sweep.analysis import _pyplot, plot_error_vs


def _runs(n):
    return [
        {"name": f"00000{i}", "summary": {"top1_err": 10.0 + i}, "overrides": {},
         "cfg": {}}
        for i in range(n)
    ]  # fmt: skip


@pytest.mark.parametrize("panels", [1, 2, 3])
def test_the_title_fits_the_figure(panels, tmp_path, monkeypatch):
    """The suptitle's extent lies inside the figure: not cut off at its sides."""
    plt = _pyplot()
    seen = {}
    savefig = plt.Figure.savefig

    def keep(fig, path, **kw):
        savefig(fig, path, **kw)
        renderer = fig.canvas.get_renderer()
        seen["title"] = fig._suptitle.get_window_extent(renderer)
        seen["figure"] = fig.bbox

    monkeypatch.setattr(plt.Figure, "savefig", keep)
    specs = [(f"x{i}", lambda r: 1.0, False) for i in range(panels)]
    plot_error_vs(_runs(4), specs, str(tmp_path / "e.png"), "error vs swept keys")
    title, figure = seen["title"], seen["figure"]
    assert figure.x0 <= title.x0 and title.x1 <= figure.x1, (title, figure)
    assert title.y1 <= figure.y1


def _run(name, status, err):
    return {
        "name": name, "status": status, "overrides": {}, "cfg": {},
        "out_dir": f"/nowhere/{name}", "error": "",
        "complexity": {"flops": 1e6, "params": 1e5},
        "summary": {"top1_err": err, "min_top1_err": err, "time_epoch_s": 1.0,
                    "epochs_done": 1, "epochs_total": 3},
        "json_stats": {},
    }  # fmt: skip


def test_only_finished_runs_rank(tmp_path, monkeypatch):
    """A failed or unfinished run with a lower error is listed, never the best."""
    from pycls_fast.sweep import analysis
    from pycls_fast.sweep.report import runs_table

    runs = [
        _run("000000", "failed", 1.0),
        _run("000001", "incomplete", 2.0),
        _run("000002", "done", 30.0),
        _run("000003", "done", 20.0),
    ]
    assert [r["name"] for r in analysis.ranked(runs)] == ["000003", "000002"]
    table = runs_table(runs, [])
    assert table.count('class="best"') == 1
    best_row = next(row for row in table.split("\n") if 'class="best"' in row)
    assert ">000003</a>" in best_row
    starred = []
    monkeypatch.setattr(
        analysis, "_scatter", lambda ax, xs, ys, names, best, log: starred.append(best)
    )
    panels = [("x", lambda r: 1.0, False)]
    analysis.plot_error_vs(runs, panels, str(tmp_path / "e.png"), "t")
    assert starred == ["000003"]
    assert analysis.best_name(runs[:2]) is None
