"""Timing helpers: budget fitting, interleaved train timing, peak memory on a CPU."""

import pytest
import torch

from pycls_fast.engine import timing
from pycls_fast.engine.trainer import build_components
from tests.helpers import tiny_cfg


@pytest.mark.parametrize(
    "per_call, warmup, iters, budget, expected",
    [
        (0.1, 3, 30, None, (3, 30)),  # no budget: unchanged
        (0.1, 3, 30, 10.0, (3, 30)),  # fits
        (1.0, 3, 30, 10.0, (1, 9)),  # scaled, warm-up first to go
        (30.0, 3, 30, 10.0, (0, 1)),  # one call is over budget: one timed call
    ],
)
def test_fit_budget(per_call, warmup, iters, budget, expected):
    assert timing.fit_budget(per_call, warmup, iters, budget) == expected


def test_time_train_is_interleaved_and_announced():
    parts = build_components(tiny_cfg("TRAIN.BATCH_SIZE", "4"), loaders=False)
    # Each call's phase, as the model and optimizer see it: a forward without grad
    # (forward), with grad (forward+backward), then an optimizer step (step).
    calls = []
    parts.model.register_forward_pre_hook(
        lambda *_: calls.append("fwd_bwd" if torch.is_grad_enabled() else "fwd")
    )
    parts.optimizer.register_step_post_hook(lambda *_: calls.__setitem__(-1, "step"))
    lines = []
    # A budget that a loaded machine still fits: the 3 timed rounds are kept.
    out = timing.time_train(parts, 4, 1, 3, budget_s=600.0, progress=lines.append)
    # Interleaved: whole rounds of the three phases in turn (a probe round, then at
    # least the 3 timed ones), never one phase's calls in a row.
    rounds = len(calls) // 3
    assert rounds >= 4 and calls == ["fwd", "fwd_bwd", "step"] * rounds, calls
    assert set(out) == {"fwd_s", "fwd_bwd_s", "step_s", "gpu_peak_mb"}
    assert all(out[k] > 0 for k in ("fwd_s", "fwd_bwd_s", "step_s"))
    assert out["gpu_peak_mb"] is None  # a CPU has no such counter
    assert len(lines) == 1 and lines[0].startswith("train (forward, forward+backward")
    assert timing.peak_memory_mb(torch.device("cpu")) is None
