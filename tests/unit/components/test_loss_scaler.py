"""LossScaler on its own: scaling, unscaling, skipping, growth and back-off, and its
state across a checkpoint (the trainer's use is tested in test_components.py)."""

import pytest
import torch

from pycls_fast.components.precision import LossScaler, MasterWeights, loss_scaler


def _param(grad):
    p = torch.nn.Parameter(torch.zeros(len(grad)))
    p.grad = torch.tensor(grad)
    return p


def _sgd(p):
    return torch.optim.SGD([p], lr=1.0, foreach=False)  # not fused: the host skips


def test_disabled_scaler_passes_everything_through():
    scaler = loss_scaler(torch.bfloat16)
    assert not scaler.enabled and scaler.scale_value == 1.0
    loss = torch.tensor(2.5)
    assert scaler.scale(loss) is loss
    p = _param([4.0])
    assert scaler.unscale_([p]) is None and p.grad.item() == 4.0
    assert scaler.step(_sgd(p), None) and p.item() == -4.0
    scaler.update(None)
    assert scaler.skipped_steps == 0
    assert loss_scaler(torch.float16).enabled


def test_unscale_divides_the_grads_and_flags_an_overflow():
    scaler = LossScaler(True, init_scale=8.0)
    assert scaler.scale(torch.tensor(0.5)).item() == 4.0
    p = _param([8.0, -16.0])
    found_inf = scaler.unscale_([p])
    assert found_inf.item() == 0.0 and p.grad.tolist() == [1.0, -2.0]
    q = _param([1.0, float("inf")])
    assert scaler.unscale_([q]).item() == 1.0


def test_overflow_skips_the_step_halves_the_scale_and_counts_it():
    scaler = LossScaler(True, init_scale=8.0, growth_interval=2)
    p = _param([float("nan")])
    found_inf = scaler.unscale_([p])
    assert not scaler.step(_sgd(p), found_inf)
    assert p.item() == 0.0  # untouched
    scaler.update(found_inf)
    assert scaler.scale_value == 4.0 and scaler.skipped_steps == 1


def test_scale_doubles_after_growth_interval_clean_steps():
    scaler = LossScaler(True, init_scale=8.0, growth_interval=3)
    scales = []
    for _ in range(6):
        p = _param([8.0])
        found_inf = scaler.unscale_([p])
        assert scaler.step(_sgd(p), found_inf)
        scaler.update(found_inf)
        scales.append(scaler.scale_value)
    assert scales == [8.0, 8.0, 16.0, 16.0, 16.0, 32.0]
    assert scaler.skipped_steps == 0


@pytest.mark.parametrize("used", [False, True], ids=["before-use", "after-use"])
def test_state_round_trips_through_a_checkpoint(used):
    a = LossScaler(True, init_scale=8.0, growth_interval=4)
    for grad in (8.0, float("inf"), 8.0):  # clean, overflow, clean
        p = _param([grad])
        found_inf = a.unscale_([p])
        a.step(_sgd(p), found_inf)
        a.update(found_inf)
    state = a.state_dict()
    assert state == {"scale": 4.0, "clean_steps": 1, "skipped_steps": 1}
    b = LossScaler(True, init_scale=2.0**16, growth_interval=4)
    if used:
        b.scale(torch.tensor(1.0))  # its device state exists already
    b.load_state_dict(state)
    assert b.state_dict() == state
    assert (b.scale_value, b.skipped_steps) == (4.0, 1)
    # Three more clean steps complete the interval of 4: the scale doubles.
    for _ in range(3):
        p = _param([4.0])
        found_inf = b.unscale_([p])
        b.step(_sgd(p), found_inf)
        b.update(found_inf)
    assert b.scale_value == 8.0


def test_master_weights_step_in_fp32_and_round_into_the_model():
    model = torch.nn.Linear(3, 2).to(torch.bfloat16)
    master = MasterWeights(model.parameters())
    w = master.master_for(model.weight)
    assert w.dtype == torch.float32 and torch.equal(w.to(torch.bfloat16), model.weight)
    model.weight.grad = torch.ones_like(model.weight)
    model.bias.grad = None
    master.grads_to_master()
    assert model.weight.grad is None and torch.equal(w.grad, torch.ones(2, 3))
    assert master.master_for(model.bias).grad is None
    with torch.no_grad():
        w.add_(1e-3)
    master.master_to_model()
    assert torch.equal(model.weight, w.to(torch.bfloat16))
    saved = master.state_dict()
    with torch.no_grad():
        w.zero_()
    master.load_state_dict(saved)
    assert torch.equal(w, saved["master"][0])
    assert torch.equal(model.weight, saved["master"][0].to(torch.bfloat16))
