"""Shared by the data-, tensor- and pipeline-parallel parity tests: STEPS training
steps of a layout on one global batch (each data-parallel rank its slice), its losses
and the whole model's weights gathered from every rank.

fp32 runs are computed in float64: a layout differs from one process only in the
order of its sums, so in float64 the two agree to within rounding noise many orders
below any real defect, whatever CPU runs them. `EXACT` is that tolerance."""

import os

import torch

from pycls_fast.config import load_cfg
from pycls_fast.engine import timing
from pycls_fast.engine.trainer import build_components, seed_everything, train_step
from pycls_fast.launch import processes as launch
from pycls_fast.models import build_model
from pycls_fast.parallel.tensor_parallel import canonical_state_dict, tp_size
from pycls_fast.runtime import distributed
from tests.helpers import EXACT, float64_default  # noqa: F401 - EXACT: for the tests

STEPS = 10


def train_and_save(cfg):
    """STEPS steps on each data-parallel rank's own fixed batch; every rank writes
    the losses and the weights it holds (pycls's q/k/v order) to a file."""
    if cfg.AMP.MODE != "fp32":
        return _train_and_save(cfg)
    with float64_default():  # see EXACT
        return _train_and_save(cfg)


def _train_and_save(cfg):
    seed_everything(0)
    parts = build_components(cfg, loaders=False)
    # One global batch; each data-parallel rank trains on its slice of it, so that
    # any layout sees the batch one process does.
    inputs, targets = timing.synthetic_batch(parts, cfg.TRAIN.BATCH_SIZE,
                                             cfg.TRAIN.IM_SIZE)  # fmt: skip
    per_rank = cfg.TRAIN.BATCH_SIZE // parts.layout.dp
    mine = slice(parts.data_rank * per_rank, (parts.data_rank + 1) * per_rank)
    inputs, targets = inputs[mine], targets[mine]
    if cfg.AMP.MODE == "fp32":
        inputs = inputs.double()
    losses = []
    for _ in range(STEPS):
        loss, _, _ = train_step(parts, inputs, targets)
        losses.append(float(loss))
    state = canonical_state_dict(parts.model, tp_size(parts.model))
    path = os.path.join(cfg.OUT_DIR, f"rank{distributed.rank()}.pt")
    torch.save({"losses": losses, "state": state}, path)
    return path


def run_layout(tmp_path, name, opts):
    """{losses: rank 0's, state: the whole model's} of training with `opts` (the
    stages of a pipeline hold disjoint parts; tensor-parallel ranks all of it)."""
    out = tmp_path / name
    out.mkdir()
    launch.launch(train_and_save, load_cfg(None, [*opts, "OUT_DIR", str(out)]))
    ranks = sorted(out.glob("rank*.pt"), key=lambda p: int(p.stem[4:]))
    first = torch.load(ranks[0])
    state = {}
    for path in ranks:
        state.update(torch.load(path)["state"])
    return {"losses": first["losses"], "state": state}


def pretrained_like(tmp_path, opts):
    """["TRAIN.WEIGHTS", file]: the model of `opts` with every parameter moved off its
    initialization by seeded noise (std 0.02), as in pretrained weights: biases
    (zero at init, the q/k/v bias included) and LayerNorm weights are no longer
    uniform, so a layout that puts one in the wrong place computes another model."""
    model = build_model(load_cfg(None, opts))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    path = tmp_path / "pretrained_like.pyth"
    torch.save({"model_state": model.state_dict()}, path)
    return ["TRAIN.WEIGHTS", str(path)]
