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
