"""EpochMeter's state: what a checkpoint keeps of the epoch in training."""

import pytest

from pycls_fast.components.meters import EpochMeter


def test_epoch_meter_state_round_trip():
    meter = EpochMeter()
    meter.add(1.5, 40.0, 10.0, 8)
    meter.add(1.0, 20.0, 0.0, 8)
    meter.skipped_at_start = 3  # the loss scaler's skipped steps at the epoch's start
    state = meter.state_dict()
    assert {k: state[k] for k in state if k != "elapsed"} == {
        "loss_sum": 20.0, "top1_sum": 480.0, "top5_sum": 80.0, "count": 16,
        "iters": 2, "skipped_at_start": 3,
    }  # fmt: skip
    again = EpochMeter()
    again.load_state_dict(state)
    assert again.skipped_at_start == 3
    again.add(2.0, 0.0, 0.0, 4)
    summary = again.summary()
    assert (summary["loss"], summary["images"]) == (pytest.approx(28.0 / 20), 20)
    assert again.elapsed() >= state["elapsed"]
