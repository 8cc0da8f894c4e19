"""TRAIN.SPIKE_*: the guard's decisions, and a planted spike skipped by the trainer
exactly (weights and optimizer state as if the step had not happened)."""

import copy
import math

import pytest
import torch

from pycls_fast.components.spike_guard import MEAN_DECAY, SpikeGuard
from pycls_fast.engine.trainer import build_components, train_step
from pycls_fast.errors import LossSpikeError
from tests.helpers import EXACT, tiny_cfg


def _run(guard, losses, judge=True):
    return [float(guard.check(torch.tensor(v), judge)) for v in losses]


def test_judges_against_the_running_mean_after_warmup():
    guard = SpikeGuard(factor=2.0, warmup=3, max_skips=5)
    # Before 3 accepted steps nothing but a non-finite loss is a spike.
    assert _run(guard, [1.0, 10.0, math.nan, 1.0]) == [0, 0, 1, 0]
    mean = 1.0
    for v in (10.0, 1.0):
        mean = MEAN_DECAY * mean + (1 - MEAN_DECAY) * v
    assert guard.state_dict()["mean"] == pytest.approx(mean, rel=EXACT["rtol"])
    assert _run(guard, [2.0 * mean + 1e-3]) == [1]  # above 2 x mean: skipped
    unchanged = guard.state_dict()["mean"]
    assert unchanged == pytest.approx(mean, rel=EXACT["rtol"])
    assert _run(guard, [2.0 * mean - 1e-3, math.inf]) == [0, 1]
    state = guard.state_dict()
    assert (state["accepted"], state["skipped"], state["in_a_row"]) == (4, 3, 1)


def test_a_rank_without_images_only_joins_the_decision():
    guard = SpikeGuard(factor=2.0, warmup=0, max_skips=5)
    _run(guard, [1.0])
    assert _run(guard, [math.nan], judge=False) == [0]
    assert guard.state_dict()["mean"] == 1.0


def test_too_many_skips_in_a_row_stop_naming_the_checkpoint(caplog):
    guard = SpikeGuard(factor=2.0, warmup=1, max_skips=2)
    _run(guard, [1.0])
    assert guard.record("epoch 1, iteration 1", lambda: "x") is False
    _run(guard, [5.0])
    assert guard.record("epoch 1, iteration 2", lambda: "ckpt_1.pyth") is True
    assert "loss spike at epoch 1, iteration 2: loss 5 > 2 x running mean 1" in (
        caplog.text
    )
    _run(guard, [1.5])  # accepted: the count starts again
    _run(guard, [9.0])
    assert guard.record("epoch 1, iteration 4", lambda: "ckpt_1.pyth") is True
    _run(guard, [9.0])
    with pytest.raises(LossSpikeError, match="2 steps in a row.*ckpt_1.pyth"):
        guard.record("epoch 1, iteration 5", lambda: "ckpt_1.pyth")


def test_restored_state_judges_as_the_uninterrupted_guard():
    losses = [1.0, 1.2, 0.9, 4.0, 1.1, 1.0, 3.5, 0.8]
    whole = SpikeGuard(2.0, 2, 5)
    want = _run(whole, losses)
    first = SpikeGuard(2.0, 2, 5)
    got = _run(first, losses[:4])
    resumed = SpikeGuard(2.0, 2, 5)
    resumed.load_state_dict(copy.deepcopy(first.state_dict()))
    got += _run(resumed, losses[4:])
    assert got == want and sum(want) == 2
    assert resumed.state_dict() == whole.state_dict()


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(16, 3, 32, 32, generator=g), torch.arange(16) % 10


def _snapshot(parts):
    return (
        copy.deepcopy(parts.model.state_dict()),
        copy.deepcopy(parts.optimizer.state_dict()),
    )


@pytest.mark.parametrize(
    "opts",
    [
        ["OPTIM.OPTIMIZER", "sgd", "OPTIM.MOMENTUM", "0.9"],  # a loop over parameters
        ["OPTIM.OPTIMIZER", "adamw", "OPTIM.MTA", "True"],  # fused: skips on device
    ],
    ids=["sgd-loop", "adamw-fused"],
)
def test_a_planted_spike_is_skipped_exactly(opts):
    """A step whose loss is planted 100x leaves weights and optimizer state as they
    were; the run then goes on exactly as a run that never saw it."""
    cfg = tiny_cfg(
        *opts, "OPTIM.BASE_LR", "0.01", "TRAIN.SPIKE_FACTOR", "3",
        "TRAIN.SPIKE_WARMUP", "2",
    )  # fmt: skip
    images, labels = _batch()

    def run(plant):
        torch.manual_seed(0)
        parts = build_components(cfg, loaders=False)
        for _ in range(3):
            train_step(parts, images, labels)
        before = _snapshot(parts)
        if plant:
            clean = parts.loss_fn
            parts.loss_fn = lambda out, y: clean(out, y) * 100
            train_step(parts, images, labels)
            parts.loss_fn = clean
            assert parts.spike_guard.record("here", lambda: "none yet") is True
            after = _snapshot(parts)
            for key, value in before[0].items():
                assert torch.equal(after[0][key], value), key
            assert str(after[1]) == str(before[1])
        train_step(parts, images, labels)
        return _snapshot(parts)[0], parts.spike_guard.skipped_steps

    planted, skipped = run(plant=True)
    clean, none = run(plant=False)
    assert (skipped, none) == (1, 0)
    for key, value in clean.items():
        assert torch.equal(planted[key], value), key


def test_checkpoints_carry_the_guard(tmp_path):
    """A checkpoint holds the guard's running mean and counters; restoring it into a
    fresh run gives the same state (a resumed run judges as an uninterrupted one)."""
    from pycls_fast.checkpoint import manager

    cfg = tiny_cfg("TRAIN.SPIKE_FACTOR", "3", "OUT_DIR", str(tmp_path))
    images, labels = _batch()
    parts = build_components(cfg, loaders=False)
    for _ in range(3):
        train_step(parts, images, labels)
    path = manager.save(parts, 0, 3)
    fresh = build_components(cfg, loaders=False)
    assert fresh.spike_guard.state_dict()["accepted"] == 0
    assert manager.restore(fresh, path) == (0, 3)
    assert fresh.spike_guard.state_dict() == parts.spike_guard.state_dict()
    assert parts.spike_guard.state_dict()["accepted"] == 3
