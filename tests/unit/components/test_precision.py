"""fp16 loss scaling's skipped steps (components/precision.py): a step skipped for an
overflow leaves the weights and the optimizer state exactly as they were, for every
optimizer the project offers, whether it skips on the host or in a fused kernel."""

import pytest
import torch

from pycls_fast.engine.trainer import build_components, train_step
from tests.helpers import tiny_cfg

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
