"""components/precision.py: fp16 loss scaling's skipped steps (a step skipped for an
overflow leaves the weights and the optimizer state exactly as they were, for every
optimizer the project offers, whether it skips on the host or in a fused kernel),
O2's gradient copy to the masters, and the TF32 flags."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pycls_fast.components.precision import apply_backend_flags, fp32_math
from pycls_fast.engine.trainer import build_components, train_step
from tests.helpers import backend_flags_restored, tiny_cfg

# (OPTIM.OPTIMIZER, OPTIM.MTA): fused kernels (SGD, Adam, AdamW on this device), the
# per-parameter loop, and timm's LAMB (which skips on the host).
OPTIMIZERS = [
    ("sgd", True),
    ("sgd", False),
    ("adam", True),
    ("adamw", True),
    ("adamw", False),
    ("lamb", True),
]
# Powers of two: scaling and unscaling are exact, so a run that skipped a step and
# one that never overflowed compute the same clean steps bit for bit.
SCALE = 2.0**10
OVERFLOW = 3e38  # the scaled loss overflows fp32 to inf


def _parts(name, mta):
    cfg = tiny_cfg(
        "AMP.MODE", "O1", "AMP.DTYPE", "fp16", "OPTIM.OPTIMIZER", name,
        "OPTIM.MTA", str(mta), "OPTIM.MOMENTUM", "0.9", "OPTIM.BASE_LR", "0.01",
    )  # fmt: skip
    torch.manual_seed(0)
    return build_components(cfg, loaders=False)


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(16, 3, 32, 32, generator=g), torch.arange(16) % 10


def _step(parts, scale):
    parts.scaler.scale_value = scale
    images, labels = _batch()
    found_inf = train_step(parts, images, labels)[2]
    return bool(found_inf.item())


def _snapshot(parts):
    """(weights, optimizer state): clones, to compare with torch.equal."""
    weights = {k: v.clone() for k, v in parts.trained.state_dict().items()}
    state = {
        i: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
        for i, s in parts.optimizer.state_dict()["state"].items()
    }
    return weights, state


def _assert_same(a, b):
    (wa, sa), (wb, sb) = a, b
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert sa.keys() == sb.keys()
    for i in sa:
        assert sa[i].keys() == sb[i].keys(), i
        for k in sa[i]:
            same = (
                torch.equal(sa[i][k], sb[i][k])
                if torch.is_tensor(sa[i][k])
                else sa[i][k] == sb[i][k]
            )
            assert same, (i, k)


@pytest.mark.parametrize("name, mta", OPTIMIZERS)
@pytest.mark.parametrize("at", ["first", "mid"])
def test_a_skipped_step_changes_nothing(name, mta, at):
    clean = _parts(name, mta)
    for _ in range(3):
        assert not _step(clean, SCALE)
    skipped = _parts(name, mta)
    if at == "mid":
        assert not _step(skipped, SCALE)
    before = _snapshot(skipped)
    assert _step(skipped, OVERFLOW)
    _assert_same(_snapshot(skipped), before)
    for _ in range(2 if at == "mid" else 3):
        assert not _step(skipped, SCALE)
    # The clean steps after the skipped one are those of a run that never overflowed.
    _assert_same(_snapshot(skipped), _snapshot(clean))


class _CountOps(TorchDispatchMode):
    """Counts the aten operators run inside it."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_grads_to_master_is_one_multi_tensor_copy():
    # O2: the model's bf16 grads become the masters' fp32 grads in one kernel per
    # step, not one per parameter (a tiny ViT has 30 parameters).
    parts = _parts_o2()
    params = [p for _, p in parts.master._pairs]
    assert len(params) >= 20
    for step in range(2):
        for i, p in enumerate(params):
            p.grad = torch.full_like(p, 1.0 + 2.0**-7 * i + step)
        expected = [p.grad.float() for p in params]
        with _CountOps() as count:
            parts.master.grads_to_master()
        if step == 1:  # the first step makes the fp32 buffers
            assert count.ops == ["aten._foreach_copy_.default"], count.ops
        for p, e in zip(params, expected):
            m = parts.master.master_for(p)
            assert p.grad is None and m.grad.dtype == torch.float32
            assert torch.equal(m.grad, e)
        parts.optimizer.zero_grad(set_to_none=True)
    # A parameter without a gradient leaves its master without one.
    params[0].grad = None
    for p in params[1:]:
        p.grad = torch.ones_like(p)
    parts.master.grads_to_master()
    assert parts.master.master_for(params[0]).grad is None
    assert torch.equal(
        parts.master.master_for(params[1]).grad,
        torch.ones_like(params[1], dtype=torch.float32),
    )


def _parts_o2():
    cfg = tiny_cfg("AMP.MODE", "O2", "AMP.DTYPE", "bf16")
    return build_components(cfg, loaders=False)


@pytest.mark.parametrize("tf32, name", [(True, "high"), (False, "highest")])
def test_tf32_keeps_the_matmul_precision_readable(tf32, name):
    # inductor's max-autotune calls torch.get_float32_matmul_precision(); it raised
    # once only the backend's fp32_precision was set.
    with backend_flags_restored() as saved:
        apply_backend_flags(tiny_cfg("AMP.TF32", str(tf32)))
        assert torch.get_float32_matmul_precision() == name
        assert fp32_math() == ("tf32" if tf32 else "ieee")
        # The CPU's matmuls keep their math.
        assert torch.backends.mkldnn.matmul.fp32_precision == saved[1]
