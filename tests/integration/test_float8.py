"""AMP.FP8 across processes (2 gloo processes, torchao's emulation): FSDP2,
pipeline and tensor parallelism train as one process does; and on the digits demo,
float8 learns as bf16 does and resumes exactly (checkpoints across precisions:
tests/unit/checkpoint/test_float8_checkpoints.py)."""

import os
import shutil

import pytest
import torch

from pycls_fast.observe.logging import load_json_stats
from tests.helpers import (
    DIGITS_CFG,
    EXACT,
    TINY,
    chance_error_bound,
    digits_opts,
    held_out_images,
    one_thread_env,
    order_tolerance,
    run_tool,
    sampling_band,
)
from tests.integration.parallel_parity import STEPS, run_layout

FP8 = ["AMP.FP8", "True", "AMP.FP8_EMULATE", "True"]
BASE = [
    *TINY, "VIT.HIDDEN_DIM", "32", "VIT.MLP_DIM", "64",
    "TRAIN.BATCH_SIZE", "8", "TEST.BATCH_SIZE", "8",
    "OPTIM.OPTIMIZER", "sgd", "OPTIM.MOMENTUM", "0.9", "OPTIM.BASE_LR", "0.05",
    "OPTIM.GRAD_CLIP", "1.0", "VIT.CLASSIFIER_TYPE", "pooled", "AMP.MODE", "fp32",
    *FP8,
]  # fmt: skip


def test_float8_on_a_cpu_is_refused_before_out_dir_exists(tmp_path):
    out = tmp_path / "run"
    result = run_tool("train_net.py", "--cfg", DIGITS_CFG, "OUT_DIR", str(out),
                      "AMP.FP8", "True")  # fmt: skip
    assert result.returncode == 2
    # One line: neither torch's warning at torchao's import nor a rank's log.
    assert result.stderr.strip() == (
        "error: AMP.FP8 True needs a GPU with float8 matmuls (compute capability "
        "8.9+: H100, H200, L4), but this run has a cpu device: set AMP.FP8 False "
        "(AMP.FP8_EMULATE True emulates them in fp32, for tests)"
    )
    assert not out.exists()


@pytest.mark.parametrize(
    "layout, micro",
    [(["FSDP.ENABLED", "True"], 2), (["PARALLEL.PP", "2"], 4)],
    ids=["fsdp2", "pp2"],
)
def test_fsdp2_and_pp2_with_float8_train_as_one_process(layout, micro, tmp_path):
    """FSDP over 2 ranks all-gathers the weights in float8, scaled from the whole
    weight's amax (precomputed after each step): the same float8 weights one
    process casts. Each rank casts its own half batch's activations with their
    own scale, as a pipeline does each of its 4 micro-batches' (2 x PP), so the
    reference is one process in as many micro-batches (TRAIN.ACCUM_STEPS): then
    the weights after the steps differ only in the order of the gradients'
    float64 sums (EXACT). (A data-parallel rank logs its own half batch's loss.)"""
    one = run_layout(tmp_path, "one", [*BASE, "TRAIN.ACCUM_STEPS", str(micro)])
    two = run_layout(tmp_path, "two", [*BASE, "NUM_GPUS", "2", *layout])
    assert one["losses"][-1] < one["losses"][0]
    assert two["state"].keys() == one["state"].keys()
    for key, value in one["state"].items():
        torch.testing.assert_close(two["state"][key], value, **EXACT)


def test_tp2_with_float8_trains_as_one_process(tmp_path):
    """Tensor parallelism over 2 ranks: each float8 cast's scale comes from the
    whole tensor's amax (a max over the DTensor's shards), so the float8 values
    are one process's. The emulated float8 matmuls sum in fp32, in another order
    where TP splits them (row-parallel halves, other kernel blockings): the runs
    differ by the fp32 order bound of the largest reduction (the weight
    gradients' 8 x 16 tokens) compounded over the steps."""
    one = run_layout(tmp_path, "one", BASE)
    tp = run_layout(tmp_path, "tp", [*BASE, "NUM_GPUS", "2", "PARALLEL.TP", "2"])
    bound = order_tolerance(torch.float32, 8 * 16, STEPS)
    torch.testing.assert_close(tp["losses"], one["losses"], rtol=bound, atol=0)
    for key, value in one["state"].items():
        diff = torch.linalg.vector_norm(tp["state"][key] - value)
        assert diff <= bound * torch.linalg.vector_norm(value), key


def _run(digits, out, *opts):
    args = ["--cfg", DIGITS_CFG, *digits_opts(digits, out, *DIGITS, *opts)]
    result = run_tool("train_net.py", *args, timeout=600, env=one_thread_env())
    assert result.returncode == 0, result.stderr[-3000:]
    return load_json_stats(os.path.join(out, "stdout.log"))


# The shrunk demo (digits_opts: 2 blocks of width 32) at a constant learning rate.
DIGITS = [
    "OPTIM.WARMUP_EPOCHS", "0", "OPTIM.BASE_LR", "0.01", "OPTIM.LR_POLICY", "lin",
    "OPTIM.MIN_LR", "1.0", "TRAIN.CHECKPOINT_PERIOD", "1", "AMP.MODE", "O1",
    "LOG_PERIOD", "1", "TRAIN.BATCH_SIZE", "64",
]  # fmt: skip


def _tests(records):
    return [r for r in records if r["_type"] == "test_epoch"]


def _iters(records, epoch):
    return [
        r["loss"]
        for r in records
        if r["_type"] == "train_iter" and r["epoch"].startswith(f"{epoch}/")
    ]


def _resume_from(src, dst, name):
    os.makedirs(os.path.join(dst, "checkpoints"))
    shutil.copy(
        os.path.join(src, "checkpoints", name),
        os.path.join(dst, "checkpoints", name),
    )


@pytest.mark.slow
def test_digits_with_float8_learns_as_bf16_and_resumes_exactly(digits, tmp_path):
    """2 epochs of the shrunk demo in bf16 (O1) and with float8: both learn (below
    chance by 5 standard errors), and their test errors differ by less than two
    independent 359-image estimates of one error may (5 standard errors of a
    difference, p = 0.5's worst case). Resumed from its epoch-1 checkpoint, the
    float8 run repeats its second epoch loss for loss."""
    epochs = ["OPTIM.MAX_EPOCH", "2"]
    bf16 = _run(digits, tmp_path / "bf16", *epochs)
    fp8 = _run(digits, tmp_path / "fp8", *epochs, *FP8)
    n = held_out_images(digits)
    margin = 100 * sampling_band(n, (2 * 0.25) ** 0.5)
    err_bf16, err_fp8 = _tests(bf16)[-1]["top1_err"], _tests(fp8)[-1]["top1_err"]
    chance = chance_error_bound(10, n)
    assert err_bf16 < chance and err_fp8 < chance
    assert abs(err_fp8 - err_bf16) <= margin

    resumed = tmp_path / "fp8_resumed"
    _resume_from(tmp_path / "fp8", resumed, "model_epoch_0001.pyth")
    again = _run(digits, resumed, *epochs, *FP8)
    assert _iters(again, 2) == _iters(fp8, 2) and _iters(again, 1) == []
