"""Tensor parallelism (PARALLEL.TP) against one process, on 2-4 gloo processes: the
same losses step by step and the same final weights, in fp32 and under AMP, with and
without sequence parallelism, composed with FSDP; checkpoints that load at another
layout."""

import pytest
import torch

from tests.helpers import TINY, amp_loss_tolerance, vit_roundings
from tests.integration.parallel_parity import EXACT, pretrained_like, run_layout

# SGD for the weight comparisons: Adam divides each gradient by its own size, so a
# gradient that is rounding noise (attn_proj's k bias: softmax ignores it) moves its
# weight by a whole step in a direction the summation order decides.
BASE = [
    *TINY, "TRAIN.BATCH_SIZE", "8", "TEST.BATCH_SIZE", "8",
    "OPTIM.OPTIMIZER", "sgd", "OPTIM.MOMENTUM", "0.9", "OPTIM.BASE_LR", "0.05",
    "OPTIM.GRAD_CLIP", "1.0", "VIT.CLASSIFIER_TYPE", "pooled",
    "VIT.LAYER_SCALE", "0.1",
]  # fmt: skip
ADAMW = ["OPTIM.OPTIMIZER", "adamw", "OPTIM.BASE_LR", "1e-3"]


@pytest.mark.parametrize(
    "extra",
    [
        ["PARALLEL.SEQUENCE_PARALLEL", "False"],
        ["PARALLEL.SEQUENCE_PARALLEL", "True"],
        ["PARALLEL.SEQUENCE_PARALLEL", "True", "VIT.LAYOUT", "batch_first"],
        # 17 tokens with the class token: the sequence stays whole.
        ["VIT.CLASSIFIER_TYPE", "token"],
        # QK-norm's LayerNorms see each rank's heads: their gradients are summed.
        ["VIT.QK_NORM", "True"],
        ["VIT.QK_NORM", "True", "PARALLEL.SEQUENCE_PARALLEL", "True"],
    ],
    ids=[
        "tp",
        "tp-sp",
        "tp-sp-batch-first",
        "tp-class-token",
        "tp-qk-norm",
        "tp-sp-qk-norm",
    ],  # fmt: skip
)
def test_tp2_trains_as_one_process_fp32(extra, tmp_path):
    # From pretrained-like weights: at init the biases are zero, and a q/k/v bias
    # left in pycls's row order would go unnoticed.
    opts = [*BASE, *extra, *pretrained_like(tmp_path, [*BASE, *extra])]
    one = run_layout(tmp_path, "one", opts)
    tp = run_layout(tmp_path, "tp", [*opts, "NUM_GPUS", "2", "PARALLEL.TP", "2"])
    torch.testing.assert_close(tp["losses"], one["losses"], **EXACT)
    assert one["losses"][-1] < one["losses"][0]
    for key, value in one["state"].items():
        assert value.dtype == torch.float64
        torch.testing.assert_close(tp["state"][key], value, **EXACT)


@pytest.mark.parametrize(
    "extra",
    [
        ["AMP.MODE", "O1"],
        ["AMP.MODE", "O1", "FSDP.ACTIVATION_CHECKPOINT", "True"],
        ["AMP.MODE", "O2", "FSDP.ENABLED", "True"],
    ],
    ids=["O1", "O1-checkpointing", "O2-fsdp"],
)
def test_tp2_under_amp_stays_within_bf16_rounding(extra, tmp_path):
    """bf16: the tensor-parallel matmuls sum their halves in another order and round
    each half (2 row-parallel outputs a block); the losses stay within the bound
    those roundings give (amp_loss_tolerance)."""
    amp = [*BASE, *ADAMW, "AMP.DTYPE", "bf16", *extra]
    one = run_layout(tmp_path, "one", amp)
    tp = run_layout(tmp_path, "tp", [*amp, "NUM_GPUS", "2", "PARALLEL.TP", "2"])
    bound = amp_loss_tolerance(one["losses"], vit_roundings(2, split_sums=2))
    torch.testing.assert_close(tp["losses"], one["losses"], rtol=0, atol=bound)
    assert tp["losses"][-1] < tp["losses"][0]


@pytest.mark.slow
def test_fsdp2_x_tp2_trains_as_fsdp2_fp32(tmp_path):
    """4 processes, FSDP over 2 data-parallel ranks x TP 2, against FSDP over 2
    processes (the same two batches); FSDP against one process is tested elsewhere."""
    fsdp = [*BASE, "FSDP.ENABLED", "True", "TRAIN.BATCH_SIZE", "16"]
    two = run_layout(tmp_path, "fsdp", [*fsdp, "NUM_GPUS", "2"])
    both = run_layout(tmp_path, "fsdp_tp", [*fsdp, "NUM_GPUS", "4", "PARALLEL.TP", "2"])
    torch.testing.assert_close(both["losses"], two["losses"], **EXACT)
    for key, value in two["state"].items():
        torch.testing.assert_close(both["state"][key], value, **EXACT)
