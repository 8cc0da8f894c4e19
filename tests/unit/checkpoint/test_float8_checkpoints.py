"""A float8 run's checkpoints (AMP.FP8, torchao's emulation) load into a bf16 run
and back, and into an export's fp32 model, as files and as sharded (DCP)
directories: the same tensors under the same names, whatever class holds them
(under FSDP with tensorwise scaling the weights are torchao's float8 all-gather
tensors)."""

import pytest
import torch
import torch.distributed as dist

from pycls_fast.checkpoint import manager
from pycls_fast.config import load_cfg
from pycls_fast.engine import timing
from pycls_fast.engine.trainer import build_components, seed_everything, train_step
from pycls_fast.export.source import load_source
from pycls_fast.launch.processes import init_single_process_group
from pycls_fast.parallel.tensor_parallel import canonical_state_dict
from tests.helpers import TINY

FP8 = ["AMP.FP8", "True", "AMP.FP8_EMULATE", "True"]


def _weights(parts) -> dict[str, torch.Tensor]:
    # `* 1` makes a plain tensor of torchao's weight wrapper (its mul is not one
    # of the ops it keeps its class through).
    return {k: v * 1 for k, v in canonical_state_dict(parts.model, 1).items()}


def _trained(cfg, seed):
    seed_everything(seed)
    parts = build_components(cfg, loaders=False)
    x, y = timing.synthetic_batch(parts, cfg.TRAIN.BATCH_SIZE, cfg.TRAIN.IM_SIZE)
    train_step(parts, x, y)  # weights off their init; float8 scales precomputed
    return parts


@pytest.mark.parametrize("fsdp", [False, True], ids=["file", "sharded"])
def test_float8_checkpoints_load_into_bf16_and_back(fsdp, tmp_path):
    opts = [
        *TINY, "VIT.HIDDEN_DIM", "32", "VIT.MLP_DIM", "64", "AMP.MODE", "O1",
        "TRAIN.BATCH_SIZE", "4", "FSDP.ENABLED", str(fsdp), "OUT_DIR", str(tmp_path),
    ]  # fmt: skip
    float8, bf16 = load_cfg(None, [*opts, *FP8]), load_cfg(None, opts)
    init_single_process_group(float8)
    try:
        parts = _trained(float8, 0)
        if fsdp:  # the case that needs torchao's tensors saved by DCP
            from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

            weight = parts.model.encoder.block_0.mlp_block.linear_1.weight
            assert isinstance(weight.to_local(), WeightWithDynamicFloat8CastTensor)
        path = manager.save(parts, 1, 0)
        assert path.endswith(".dcp" if fsdp else ".pyth")
        saved = _weights(parts)
        into_bf16 = build_components(bf16, loaders=False)
        assert manager.restore(into_bf16, path) == (1, 0)
        loaded = _weights(into_bf16)
        assert loaded.keys() == saved.keys()
        for key, value in saved.items():
            assert torch.equal(loaded[key], value), key
        # An export's model (export/source.py): plain fp32 layers, the same values.
        exported = load_source(float8, path).model
        assert type(exported.encoder.block_0.mlp_block.linear_1) is torch.nn.Linear
        for key, value in exported.state_dict().items():
            assert torch.equal(value, saved[key].float()), key
        # And back: a bf16 step's checkpoint into a float8 run.
        x, y = timing.synthetic_batch(into_bf16, 4, bf16.TRAIN.IM_SIZE)
        train_step(into_bf16, x, y)
        path = manager.save(into_bf16, 2, 0)
        saved = _weights(into_bf16)
        back = build_components(float8, loaders=False)
        assert manager.restore(back, path) == (2, 0)
        for key, value in _weights(back).items():
            assert torch.equal(value, saved[key]), key
        loss, _, _ = train_step(back, x, y)
        assert torch.isfinite(loss)
    finally:
        dist.destroy_process_group()
