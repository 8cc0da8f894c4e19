"""The goodput account: categories timed, shares summing to the wall time, and a
requeued run charged with the training it redoes."""

import json
import time

import pytest

from pycls_fast.observe.goodput import CATEGORIES, FILE, Goodput


def _busy(seconds):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_spans_fill_their_categories_and_shares_sum_to_one(tmp_path):
    account = Goodput(str(tmp_path))
    _busy(0.02)  # start-up
    with account.span("train"):
        _busy(0.04)
        account.data_wait(0.01)  # the loader's running total in this span
        with account.span("checkpoint"):
            _busy(0.02)
    with account.span("eval"):
        _busy(0.02)
    secs = account.seconds()
    assert secs["startup"] >= 0.02 and secs["eval"] >= 0.02
    assert secs["checkpoint"] >= 0.02 and secs["data"] == pytest.approx(0.01)
    # The train span less its data wait and checkpoint stall.
    assert 0.03 <= secs["step"] < secs["wall"] - 0.06
    fields = account.fields()
    assert sum(fields[f"wall_{c}_frac"] for c in CATEGORIES) == pytest.approx(1.0)
    assert fields["goodput"] == fields["wall_step_frac"]


def _planted(tmp_path, position, train_s, marks, wall=100.0):
    """goodput.json as an interrupted run leaves it: `train_s` seconds of steps by
    global iteration `position`, checkpoints at `marks` {position: train seconds}."""
    state = {
        "totals": {"step": train_s, "data": 0.0, "eval": 5.0, "checkpoint": 1.0,
                   "startup": 4.0},
        "lost": 0.0, "wall": wall, "position": position,
        "marks": {str(k): v for k, v in marks.items()}, "runs": 1,
    }  # fmt: skip
    (tmp_path / FILE).write_text(json.dumps(state))


def test_a_requeued_run_is_charged_from_the_resumed_checkpoint(tmp_path):
    # The run reached iteration 30 after 60 s of steps; its checkpoint at 20 was
    # taken at 40 s: resuming there redoes 20 s.
    _planted(tmp_path, 30, 60.0, {0: 0.0, 20: 40.0})
    account = Goodput(str(tmp_path))
    account.resumed_at(20)
    secs = account.seconds()
    assert secs["lost"] == pytest.approx(20.0)
    assert secs["step"] == pytest.approx(40.0)  # 60 measured, 20 of them redone
    assert secs["wall"] >= 100.0 and account.fields()["restarts"] == 1
    account.save()
    # Killed again before a new checkpoint, at 10 s more of steps: resuming at 20
    # once more redoes those 10 s, not the earlier 20 again.
    saved = json.loads((tmp_path / FILE).read_text())
    saved["position"] = 25
    saved["totals"]["step"] += 10.0
    (tmp_path / FILE).write_text(json.dumps(saved))
    again = Goodput(str(tmp_path))
    again.resumed_at(20)
    assert again.seconds()["lost"] == pytest.approx(30.0)
    assert again.fields()["restarts"] == 2


def test_no_loss_when_resuming_where_the_run_stopped(tmp_path):
    _planted(tmp_path, 20, 40.0, {0: 0.0, 20: 40.0})
    account = Goodput(str(tmp_path))
    account.resumed_at(20)
    assert account.seconds()["lost"] == 0.0
