"""engine/inference.py: the batch back-off on out-of-memory, and rows of ours and
timm's side by side."""

import pytest
import torch

from pycls_fast.engine.inference import (
    CSV_FIELDS,
    OURS,
    TIMM,
    build_models,
    fitting_batch,
    format_rows,
    measure_inference,
)
from pycls_fast.errors import UserError
from tests.helpers import EXACT, tiny_cfg


def test_backs_off_in_timm_steps_until_the_batch_fits():
    tried = []

    def try_batch(size):
        tried.append(size)
        if size > 40:
            raise torch.OutOfMemoryError(f"{size} images do not fit")

    assert fitting_batch(try_batch, 256) == 32
    assert tried == [256, 192, 128, 96, 64, 48, 32]
    assert fitting_batch(try_batch, 24) == 24


def test_nothing_fits():
    def try_batch(size):
        raise torch.OutOfMemoryError("no memory")

    with pytest.raises(UserError, match="not even a batch of 1"):
        fitting_batch(try_batch, 4)


def test_rows_of_ours_and_timm():
    cfg = tiny_cfg("AMP.MODE", "fp32")
    device = torch.device("cpu")
    models = build_models(cfg, device)
    rows = measure_inference(
        cfg, models, [1, 3], device, rounds=2, iters=1, warmup=1, min_turn_s=0
    )
    assert [(r["model"], r["infer_batch_size"]) for r in rows] == [
        (OURS, 1), (TIMM, 1), (OURS, 3), (TIMM, 3),
    ]  # fmt: skip
    for ours, timm in (rows[0:2], rows[2:4]):
        assert set(ours) == set(CSV_FIELDS)
        assert ours["infer_samples_per_sec"] > 0 and timm["ratio_to_timm"] == 1.0
        expected = ours["infer_samples_per_sec"] / timm["infer_samples_per_sec"]
        assert ours["ratio_to_timm"] == pytest.approx(expected, rel=EXACT["rtol"])
        speed = ours["infer_batch_size"] / (ours["infer_step_time"] / 1e3)
        assert ours["infer_samples_per_sec"] == pytest.approx(speed, rel=EXACT["rtol"])
    assert "| 3 | pycls_fast |" in format_rows(rows)


def test_a_turn_lasts_at_least_min_turn_s(monkeypatch):
    """Forwards of a few milliseconds are timed in turns of enough of them to fill
    min_turn_s, not `iters` alone (the clock made exact: 2 ms a forward)."""
    from pycls_fast.engine import inference

    counts = []

    def seconds(fn, device, n):
        counts.append(n)
        return 0.002

    monkeypatch.setattr(inference, "_seconds", seconds)
    cfg = tiny_cfg("AMP.MODE", "fp32")
    models = {OURS: torch.nn.Identity(), TIMM: torch.nn.Identity()}
    measure_inference(cfg, models, [1], torch.device("cpu"), rounds=2, iters=3,
                      warmup=1, min_turn_s=0.05)  # fmt: skip
    # One forward of each to calibrate, then 2 rounds of both in turns of 25.
    assert counts == [1, 1, 25, 25, 25, 25]
