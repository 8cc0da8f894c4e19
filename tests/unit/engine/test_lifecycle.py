"""engine/lifecycle.py: what a run says when it starts."""

import logging
from types import SimpleNamespace

import pytest
import torch

from pycls_fast.components.precision import AmpMode
from pycls_fast.engine import lifecycle
from tests.helpers import tiny_cfg


@pytest.mark.parametrize("main", [True, False])
def test_schedule_warnings_are_said_once_per_job(main, monkeypatch, caplog):
    """Rank 0 warns of a warmup longer than the run; the other ranks do not repeat
    it (they log warnings too, so it came once per rank)."""
    cfg = tiny_cfg("OPTIM.WARMUP_EPOCHS", "2", "OPTIM.MAX_EPOCH", "1")
    parts = SimpleNamespace(
        model=torch.nn.Linear(2, 2), mode=AmpMode.FP32, half_dtype=torch.bfloat16,
        train_loader=[0] * 3, test_loader=[0], layout=SimpleNamespace(dp=1),
    )  # fmt: skip
    monkeypatch.setattr(lifecycle.distributed, "is_main", lambda: main)
    with caplog.at_level(logging.INFO, logger="pycls_fast"):
        lifecycle.describe_run(cfg, parts)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == (1 if main else 0), warnings
    if main:
        assert warnings[0].startswith("warning: OPTIM.WARMUP_EPOCHS (2) >= ")
