"""Shared by the tensor- and pipeline-parallel parity tests: STEPS training steps of
a layout, its losses and the whole model's weights gathered from every rank.

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

STEPS = 10

# sqrt(float64 eps) ~ 1.5e-8: float64 summation-order noise (n * eps ~ 1e-13 for the
# reductions of a tiny model, amplified over STEPS steps) stays far below it, and a
# defect (a wrong shard, a missing all-reduce) moves weights by 1e-3 or more.
EXACT = {"rtol": torch.finfo(torch.float64).eps ** 0.5, "atol": 1e-12}


def train_and_save(cfg):
    """STEPS steps on each data-parallel rank's own fixed batch; every rank writes
    the losses and the weights it holds (pycls's q/k/v order) to a file."""
    if cfg.AMP.MODE == "fp32":
        torch.set_default_dtype(torch.float64)  # see EXACT
    try:
        return _train_and_save(cfg)
    finally:
        torch.set_default_dtype(torch.float32)


def _train_and_save(cfg):
    seed_everything(0)
    parts = build_components(cfg, loaders=False)
    per_rank = cfg.TRAIN.BATCH_SIZE // parts.layout.dp
    inputs, targets = timing.synthetic_batch(parts, per_rank, cfg.TRAIN.IM_SIZE)
    if cfg.AMP.MODE == "fp32":
        inputs = inputs.double()
    inputs = inputs + parts.data_rank  # the data-parallel ranks' batches differ
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
