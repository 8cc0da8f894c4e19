"""The pure parts of tensor parallelism: the q/k/v row order, its checkpoint pieces,
when sequence parallelism applies, and the PARALLEL.* checks."""

import pytest
import torch

from pycls_fast.config import load_cfg
from pycls_fast.errors import ConfigError
from pycls_fast.parallel.mesh import Layout
from pycls_fast.parallel.tensor_parallel import (
    _canonical_runs,
    qkv_rank_order,
    sequence_parallel,
)
from tests.helpers import TINY


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_each_rank_holds_the_q_k_v_rows_of_its_own_heads(tp):
    hidden = 8
    rows = torch.arange(3 * hidden)  # row i of pycls's order holds the value i
    ordered = rows[qkv_rank_order(3 * hidden, tp)]
    per_rank = ordered.view(tp, 3, hidden // tp)
    for r in range(tp):
        for j in range(3):  # q, k, v
            start = j * hidden + r * hidden // tp
            assert per_rank[r, j].tolist() == list(range(start, start + hidden // tp))


@pytest.mark.parametrize("tp,start,n", [(2, 0, 12), (2, 12, 12), (2, 5, 9), (4, 3, 7)])
def test_checkpoint_pieces_name_the_rows_by_their_place_in_q_k_v(tp, start, n):
    rows = 24
    ordered = torch.arange(rows)[qkv_rank_order(rows, tp)]
    local = ordered[start : start + n]
    runs = _canonical_runs(start, n, rows, tp)
    assert sum(length for _, _, length in runs) == n
    for lo, canonical, length in runs:
        assert local[lo : lo + length].tolist() == list(
            range(canonical, canonical + length)
        )


def test_sequence_parallel_needs_every_token_count_divisible():
    pooled = [*TINY, "VIT.CLASSIFIER_TYPE", "pooled", "NUM_GPUS", "2"]
    assert sequence_parallel(load_cfg(None, [*pooled, "PARALLEL.TP", "2"]))
    assert not sequence_parallel(load_cfg(None, [*pooled, "PARALLEL.TP", "1"]))
    off = [*pooled, "PARALLEL.TP", "2", "PARALLEL.SEQUENCE_PARALLEL", "False"]
    assert not sequence_parallel(load_cfg(None, off))
    # 16 patches + a class token = 17 tokens.
    token = [*TINY, "VIT.CLASSIFIER_TYPE", "token", "NUM_GPUS", "2", "PARALLEL.TP", "2"]
    assert not sequence_parallel(load_cfg(None, token))


def test_layout_orders_tensor_parallel_ranks_innermost():
    layout = Layout(pp=2, dp=2, tp=2)
    coords = [layout.coords(r) for r in range(8)]
    assert coords[:4] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
    assert coords[4] == (1, 0, 0)
    assert [layout.data_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert layout.describe() == "PP 2 x DP 2 x TP 2"


@pytest.mark.parametrize(
    "opts,message",
    [
        (["NUM_GPUS", "3", "PARALLEL.TP", "2"], "must be a multiple of PARALLEL.TP"),
        (["NUM_GPUS", "2", "PARALLEL.TP", "2", "VIT.NUM_HEADS", "3",
          "VIT.HIDDEN_DIM", "48"], "VIT.NUM_HEADS (3) must be divisible"),
        (["NUM_GPUS", "4", "PARALLEL.TP", "2"], "needs FSDP.ENABLED True"),
        (["NUM_GPUS", "2", "PARALLEL.TP", "2", "AMP.MODE", "O2"], "AMP.MODE O2"),
        (["NUM_GPUS", "4", "PARALLEL.PP", "4"], "at least the 4 pipeline stages"),
        (["NUM_GPUS", "2", "PARALLEL.PP", "2", "PARALLEL.PP_MICROBATCHES", "3"],
         "must split into 1 data-parallel ranks x 3"),
        (["NUM_GPUS", "2", "PARALLEL.PP", "2", "PARALLEL.PP_SCHEDULE", "interleaved",
          "VIT.NUM_LAYERS", "4", "PARALLEL.PP_MICROBATCHES", "5",
          "TRAIN.BATCH_SIZE", "20"], "must be a multiple of PARALLEL.PP (2)"),
        (["NUM_GPUS", "2", "PARALLEL.PP", "2", "TRAIN.ACCUM_STEPS", "2"],
         "TRAIN.ACCUM_STEPS is not supported with PARALLEL.PP"),
    ],
)  # fmt: skip
def test_parallel_layouts_that_cannot_work_get_one_line(opts, message):
    with pytest.raises(ConfigError) as e:
        load_cfg(None, [*TINY, "TRAIN.BATCH_SIZE", "16", *opts])
    assert message in str(e.value) and "\n" not in str(e.value)
