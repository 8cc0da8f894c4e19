"""The planner's per-rank memory against what 2 gloo processes hold: parameters,
gradients, optimizer state, master weights and EMA, measured from the tensors, under
DDP, FSDP, TP, FSDP x TP, PP and interleaved PP x FSDP, in fp32 and AMP (within 10%,
as the issue asks)."""

import pytest
import torch

from pycls_fast.config import load_cfg
from pycls_fast.engine import timing
from pycls_fast.engine.trainer import (
    build_components,
    forward_backward,
    seed_everything,
    train_step,
)
from pycls_fast.launch import processes as launch
from pycls_fast.parallel.planner import Candidate, per_rank_memory
from pycls_fast.runtime import distributed
from tests.helpers import TINY


def _bytes(tensors):
    seen, total = set(), 0
    for t in tensors:
        if t is None or id(t) in seen:
            continue
        seen.add(id(t))
        local = distributed.local_tensor(t)
        total += local.numel() * local.element_size()
    return total


def _measure(cfg):
    """Rank 0's bytes by part after a step, with the next step's gradients made."""
    seed_everything(0)
    parts = build_components(cfg, loaders=False)
    per_rank = cfg.TRAIN.BATCH_SIZE // distributed.world_size()
    inputs, targets = timing.synthetic_batch(parts, per_rank, cfg.TRAIN.IM_SIZE)
    train_step(parts, inputs, targets)  # creates the optimizer state
    forward_backward(parts, inputs, targets)  # the next step's gradients
    if parts.master is not None:
        parts.master.grads_to_master()
    model_params = list(parts.model.parameters())
    masters = [p for p in parts.opt_params if all(p is not q for q in model_params)]
    state = [v for s in parts.optimizer.state.values() for k, v in s.items()
             if torch.is_tensor(v) and k != "step"]  # fmt: skip
    mine = {
        "params": _bytes(model_params),
        "grads": _bytes(p.grad for p in parts.opt_params),
        "optimizer": _bytes(state),
        "master": _bytes(masters),
        "ema": _bytes(parts.ema.parameters()) if parts.ema is not None else 0,
    }
    # The planner predicts the rank that holds the most (a pipeline's are unequal).
    return max(distributed.all_gather_object(mine), key=lambda m: sum(m.values()))


LAYOUTS = {
    "ddp": (["FSDP.ENABLED", "False"], Candidate(dp=2)),
    "fsdp": (["FSDP.ENABLED", "True"], Candidate(dp=2, fsdp=True)),
    "tp2": (["PARALLEL.TP", "2"], Candidate(tp=2)),
    "pp2": (["PARALLEL.PP", "2"], Candidate(pp=2, micro=4)),
    "pp2-interleaved-fsdp": (
        [
            "PARALLEL.PP",
            "2",
            "PARALLEL.PP_SCHEDULE",
            "interleaved",
            "VIT.NUM_LAYERS",
            "4",
            "FSDP.ENABLED",
            "True",
        ],
        Candidate(pp=2, fsdp=True, micro=4),
    ),  # fmt: skip
    "tp2-pp2": (
        ["NUM_GPUS", "4", "PARALLEL.TP", "2", "PARALLEL.PP", "2"],
        Candidate(pp=2, tp=2, micro=4),
    ),
    "tp2-fsdp": (
        ["PARALLEL.TP", "2", "FSDP.ENABLED", "True"],
        Candidate(tp=2, fsdp=True),
    ),
}


@pytest.mark.parametrize(
    "layout,mode",
    [("ddp", "fp32"), ("ddp", "O2"), ("fsdp", "fp32"), ("fsdp", "O2"),
     ("tp2", "fp32"), ("tp2", "O1"), ("tp2-fsdp", "O2"), ("pp2", "fp32"),
     ("pp2-interleaved-fsdp", "O2"), ("tp2-pp2", "fp32")],
)  # fmt: skip
def test_predicted_memory_is_what_the_ranks_hold(layout, mode, tmp_path):
    keys, candidate = LAYOUTS[layout]
    opts = [*TINY, "NUM_GPUS", "2", "TRAIN.BATCH_SIZE", "8", "TEST.BATCH_SIZE", "8",
            *keys, "AMP.MODE", mode, "OPTIM.OPTIMIZER", "adamw",
            "OPTIM.EMA_ALPHA", "1e-4", "VIT.HIDDEN_DIM", "64", "VIT.MLP_DIM", "256",
            "OUT_DIR", str(tmp_path)]  # fmt: skip
    cfg = load_cfg(None, opts)
    measured = launch.launch(_measure, cfg)
    predicted = per_rank_memory(cfg, candidate)
    for part, value in measured.items():
        if value == 0:
            assert predicted[part] == 0, part
            continue
        assert abs(predicted[part] - value) / value <= 0.10, (part, predicted, measured)
    if layout != "ddp":  # sharded or split: well under DDP's
        ddp = per_rank_memory(cfg, Candidate(dp=2))
        assert predicted["optimizer"] < 0.75 * ddp["optimizer"]


def _dry_run_ratio(opts):
    """(measured / planner total, measured step bytes) of rank 0's dry run of
    ViT-H-14.yaml with `opts`: in a process of its own (one dry run a process)."""
    from pycls_fast.engine.dry_run import dry_run

    report = dry_run(load_cfg("configs/vit/ViT-H-14.yaml", opts), 0)
    return report.measured["total"] / report.predicted["total"]


def test_dry_run_of_float8_agrees_with_the_planner_as_bf16_does():
    """AMP.FP8 (tensorwise: FSDP gathers the float8 weights in 1 byte, no
    autocast casts of them, the eager float8 casts of the largest operand) moves
    the dry run's measured memory as the planner's float8 terms predict: the
    measured / planner ratio stays within 2% of bf16's at the same layout (at this
    width both are ~1.10; ViT-H/14 at 64 FSDP ranks: 1.07 with float8, 1.06 in
    bf16, docs/DISTRIBUTED.md)."""
    import multiprocessing

    opts = ["NUM_GPUS", "4", "TRAIN.BATCH_SIZE", "32", "FSDP.ENABLED", "True",
            "VIT.NUM_LAYERS", "4", "VIT.HIDDEN_DIM", "256", "VIT.MLP_DIM", "1024",
            "VIT.NUM_HEADS", "4"]  # fmt: skip
    with multiprocessing.get_context("spawn").Pool(1, maxtasksperchild=1) as pool:
        bf16 = pool.apply(_dry_run_ratio, (opts,))
        fp8 = pool.apply(_dry_run_ratio, ([*opts, "AMP.FP8", "True"],))
    assert abs(fp8 - bf16) <= 0.02, (fp8, bf16)
