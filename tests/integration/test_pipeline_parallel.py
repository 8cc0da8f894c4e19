"""Pipeline parallelism (PARALLEL.PP) against one process, on 2-4 gloo processes:
the same losses step by step and the same final weights with each schedule, with
the batch-first layout, composed with tensor parallelism and FSDP, under AMP."""

import pytest
import torch

from pycls_fast.config import load_cfg
from pycls_fast.engine import timing
from pycls_fast.engine.trainer import build_components, seed_everything, train_step
from pycls_fast.launch import processes as launch
from tests.helpers import TINY, amp_loss_tolerance, float64_default, vit_roundings
from tests.integration.parallel_parity import EXACT, run_layout

BASE = [
    *TINY, "VIT.NUM_LAYERS", "4", "TRAIN.BATCH_SIZE", "8", "TEST.BATCH_SIZE", "8",
    "OPTIM.OPTIMIZER", "sgd", "OPTIM.MOMENTUM", "0.9", "OPTIM.BASE_LR", "0.05",
    "OPTIM.GRAD_CLIP", "1.0", "VIT.CLASSIFIER_TYPE", "pooled",
]  # fmt: skip


def _same(got, want):
    """Equal up to float64 summation order (parallel_parity.EXACT)."""
    torch.testing.assert_close(got["losses"], want["losses"], **EXACT)
    assert want["losses"][-1] < want["losses"][0]
    assert got["state"].keys() == want["state"].keys()
    for key, value in want["state"].items():
        assert value.dtype == torch.float64
        torch.testing.assert_close(got["state"][key], value, **EXACT)


@pytest.mark.parametrize(
    "extra",
    [
        ["PARALLEL.PP_SCHEDULE", "gpipe"],
        ["PARALLEL.PP_SCHEDULE", "1f1b"],
        ["PARALLEL.PP_SCHEDULE", "interleaved"],
        ["PARALLEL.PP_SCHEDULE", "1f1b", "VIT.LAYOUT", "batch_first",
         "VIT.CLASSIFIER_TYPE", "token", "PARALLEL.PP_MICROBATCHES", "4"],
    ],
    ids=["gpipe", "1f1b", "interleaved", "1f1b-batch-first-token"],
)  # fmt: skip
def test_pp2_trains_as_one_process_fp32(extra, tmp_path):
    one = run_layout(tmp_path, "one", [*BASE, *extra])
    pp = run_layout(
        tmp_path, "pp", [*BASE, *extra, "NUM_GPUS", "2", "PARALLEL.PP", "2"]
    )
    _same(pp, one)


@pytest.mark.slow
def test_tp2_x_pp2_trains_as_one_process_fp32(tmp_path):
    """4 processes: two pipeline stages, each split over 2 tensor-parallel ranks
    (sequence parallel)."""
    one = run_layout(tmp_path, "one", BASE)
    both = run_layout(
        tmp_path,
        "tp_pp",
        [*BASE, "NUM_GPUS", "4", "PARALLEL.PP", "2", "PARALLEL.TP", "2"],
    )
    _same(both, one)


@pytest.mark.slow
def test_fsdp2_x_pp2_trains_as_fsdp2_fp32(tmp_path):
    """4 processes: two stages, each sharded over 2 data-parallel ranks, against
    FSDP over 2 processes (the same two batches)."""
    fsdp = [*BASE, "FSDP.ENABLED", "True", "TRAIN.BATCH_SIZE", "16"]
    two = run_layout(tmp_path, "fsdp", [*fsdp, "NUM_GPUS", "2"])
    both = run_layout(tmp_path, "fsdp_pp", [*fsdp, "NUM_GPUS", "4", "PARALLEL.PP", "2"])
    _same(both, two)


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_pp2_under_amp_stays_within_bf16_rounding(schedule, tmp_path):
    """bf16 O1 with AdamW: micro-batches round their matmuls and weight gradients
    apart; the losses stay within the bound those roundings give
    (amp_loss_tolerance)."""
    amp = [*BASE, "OPTIM.OPTIMIZER", "adamw", "OPTIM.BASE_LR", "1e-3",
           "AMP.MODE", "O1", "AMP.DTYPE", "bf16",
           "PARALLEL.PP_SCHEDULE", schedule]  # fmt: skip
    one = run_layout(tmp_path, "one", amp)
    pp = run_layout(tmp_path, "pp", [*amp, "NUM_GPUS", "2", "PARALLEL.PP", "2"])
    bound = amp_loss_tolerance(one["losses"], vit_roundings(4))
    torch.testing.assert_close(pp["losses"], one["losses"], rtol=0, atol=bound)
    assert pp["losses"][-1] < pp["losses"][0]


def test_pp2_with_activation_checkpointing(tmp_path):
    ac = [*BASE, "FSDP.ACTIVATION_CHECKPOINT", "True"]
    one = run_layout(tmp_path, "one", ac)
    pp = run_layout(tmp_path, "pp", [*ac, "NUM_GPUS", "2", "PARALLEL.PP", "2"])
    _same(pp, one)


def _short_step(cfg):
    """One step on 6 of the batch's 8 images (2 were bad); rank 0 returns the loss.
    With `filled` in OUT_DIR's name, one process steps on the batch the pipeline
    fills: the 6 images, then the first 2 again."""
    seed_everything(0)
    with float64_default():  # the same images' loss summed in another order: EXACT
        parts = build_components(cfg, loaders=False)
        inputs, targets = timing.synthetic_batch(parts, 8, cfg.TRAIN.IM_SIZE)
        keep = torch.arange(6)
        if "filled" in cfg.OUT_DIR:
            keep = torch.arange(8) % 6
        loss, logits, _ = train_step(parts, inputs[keep].double(), targets[keep])
    assert loss.dtype == torch.float64
    assert len(logits) == len(keep)
    return float(loss)


def test_a_batch_short_of_bad_images_is_filled_with_its_own(tmp_path):
    pp = [*BASE, "NUM_GPUS", "2", "PARALLEL.PP", "2"]
    short = launch.launch(
        _short_step, load_cfg(None, [*pp, "OUT_DIR", str(tmp_path / "short")])
    )
    filled = launch.launch(
        _short_step, load_cfg(None, [*BASE, "OUT_DIR", str(tmp_path / "filled")])
    )
    assert short == pytest.approx(filled, rel=EXACT["rtol"], abs=EXACT["atol"])


def _step_with_an_overflow_in_the_last_stage(cfg):
    """One fp16 step in which only the last stage's gradients overflow; rank 0 (the
    first stage, whose own gradients are finite) returns (its found_inf, whether
    its weights stayed, the loss scale before and after)."""
    import torch.distributed as dist

    seed_everything(0)
    parts = build_components(cfg, loaders=False)
    if dist.get_rank() == 1:
        for p in parts.model.parameters():
            p.register_hook(lambda g: torch.full_like(g, float("inf")))
    before = {k: v.clone() for k, v in parts.model.state_dict().items()}
    scale = float(parts.scaler.scale(torch.ones(())))
    inputs, targets = timing.synthetic_batch(parts, 8, cfg.TRAIN.IM_SIZE)
    _, _, found_inf = train_step(parts, inputs, targets)
    after = parts.model.state_dict()
    stayed = all(torch.equal(after[k], v) for k, v in before.items())
    return float(found_inf), stayed, scale, float(parts.scaler.scale(torch.ones(())))


def test_an_fp16_overflow_in_one_stage_skips_the_step_in_all():
    cfg = load_cfg(None, [*BASE, "NUM_GPUS", "2", "PARALLEL.PP", "2",
                          "AMP.MODE", "O1", "AMP.DTYPE", "fp16"])  # fmt: skip
    found_inf, stayed, scale, new_scale = launch.launch(
        _step_with_an_overflow_in_the_last_stage, cfg
    )
    assert found_inf == 1.0 and stayed
    assert new_scale == scale / 2  # both stages back off alike
