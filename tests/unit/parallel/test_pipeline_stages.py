"""Pipeline stages: balanced block ranges, pruned copies of the ViT that chained
give the whole model's logits and gradients under its parameter names, a rank's
stages as one module."""

import itertools

import pytest
import torch

from pycls_fast.models import build_model
from pycls_fast.parallel.pipeline import (
    _costs,
    rank_stage_indices,
    split_model,
    stage_bounds,
    stage_union,
)
from tests.helpers import EXACT, float64_default, tiny_cfg


def _cfg(*opts):
    return tiny_cfg("VIT.NUM_LAYERS", "6", "NUM_GPUS", "2", "PARALLEL.PP", "2",
                    "TRAIN.BATCH_SIZE", "16", *opts)  # fmt: skip


def test_blocks_are_split_evenly_when_the_ends_cost_little():
    assert stage_bounds(_cfg(), 2) == [(0, 3), (3, 6)]
    assert stage_bounds(_cfg(), 3) == [(0, 2), (2, 4), (4, 6)]
    assert stage_bounds(_cfg(), 6) == [(i, i + 1) for i in range(6)]
    with pytest.raises(ValueError):
        stage_bounds(_cfg(), 7)


def test_a_costly_head_or_stem_moves_blocks_to_the_other_stages():
    # A 200k-class head costs more than a block here: the last stage gets fewer.
    head = stage_bounds(_cfg("MODEL.NUM_CLASSES", "200000"), 2)
    assert head[0][1] - head[0][0] > head[1][1] - head[1][0]
    stem = ["VIT.STEM_TYPE", "conv", "VIT.C_STEM_KERNELS", "[3, 3, 1]",
            "VIT.C_STEM_STRIDES", "[2, 2, 2]",
            "VIT.C_STEM_DIMS", "[256, 512, 48]"]  # fmt: skip
    first = stage_bounds(_cfg(*stem), 2)
    assert first[0][1] - first[0][0] < first[1][1] - first[1][0]
    for bounds in (head, first):
        assert bounds[0][0] == 0 and bounds[-1][1] == 6
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))


def test_interleaved_ranks_hold_stages_r_and_r_plus_pp():
    cfg = _cfg("PARALLEL.PP_SCHEDULE", "interleaved")
    assert rank_stage_indices(cfg, 0) == [0, 2]
    assert rank_stage_indices(cfg, 1) == [1, 3]
    assert rank_stage_indices(_cfg(), 1) == [1]


@pytest.mark.parametrize("layout", ["batch_second", "batch_first"])
def test_chained_stages_are_the_whole_model(layout):
    cfg = _cfg("PARALLEL.PP_SCHEDULE", "interleaved", "VIT.LAYOUT", layout,
               "VIT.CLASSIFIER_TYPE", "token")  # fmt: skip
    torch.manual_seed(0)
    # The stages chained are the whole model's math in another grouping: float64
    # agrees at EXACT on any CPU.
    with float64_default():
        whole = build_model(cfg)
        copies = [build_model(cfg) for _ in range(2)]
        x = torch.randn(4, 3, 32, 32)
    torch.nn.init.normal_(whole.head.head_fc.weight)  # pycls inits it to zeros
    y = torch.tensor([1, 2, 3, 4])
    torch.nn.functional.cross_entropy(whole(x), y).backward()
    stages = []
    for rank, copy in enumerate(copies):
        copy.load_state_dict(whole.state_dict())
        stages += split_model(copy, cfg, rank)
    stages.sort(key=lambda s: s[0])
    assert [i for i, _ in stages] == [0, 1, 2, 3]
    out = x
    for _, stage in stages:
        out = stage(out)
    torch.testing.assert_close(out, whole(x), **EXACT)
    torch.nn.functional.cross_entropy(out, y).backward()
    grads = {}
    for _, stage in stages:
        for name, p in stage.named_parameters():
            assert name not in grads  # each parameter on exactly one stage
            grads[name] = p.grad
    assert grads.keys() == dict(whole.named_parameters()).keys()
    for name, p in whole.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, **EXACT)
    # A rank's two stages as one module, under the whole model's names.
    union = stage_union([m for i, m in stages if i in (0, 2)])
    names = {n for i, m in stages if i in (0, 2) for n, _ in m.named_parameters()}
    assert {n for n, _ in union.named_parameters()} == names
    assert set(union.state_dict()) <= set(whole.state_dict())


@pytest.mark.parametrize("classes", ["10", "3000", "20000", "100000"])
def test_stage_bounds_are_the_best_contiguous_split(classes):
    """Against every way of cutting 8 blocks into 2-5 non-empty stages: no split has
    a cheaper most expensive stage (stem on the first, head on the last)."""
    cfg = _cfg("VIT.NUM_LAYERS", "8", "MODEL.NUM_CLASSES", classes)
    stem, blocks, head = _costs(cfg)

    def worst(bounds):
        costs = [sum(blocks[a:b]) for a, b in bounds]
        costs[0] += stem
        costs[-1] += head
        return max(costs)

    for n in range(2, 6):
        bounds = stage_bounds(cfg, n)
        assert len(bounds) == n and bounds[0][0] == 0 and bounds[-1][1] == 8
        assert all(a < b for a, b in bounds)
        assert all(x[1] == y[0] for x, y in zip(bounds, bounds[1:]))
        splits = itertools.combinations(range(1, 8), n - 1)
        best = min(worst(list(zip((0, *c), (*c, 8)))) for c in splits)
        assert worst(bounds) == best
