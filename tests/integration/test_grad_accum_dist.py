"""TRAIN.ACCUM_STEPS under DDP and FSDP (2 gloo processes): the same weights as the
whole batch, and one gradient reduction per step, after the last micro-batch."""

import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from pycls_fast.config import load_cfg
from pycls_fast.engine import timing
from pycls_fast.engine.trainer import build_components, seed_everything, train_step
from pycls_fast.launch import processes as launch
from pycls_fast.models import build_model
from pycls_fast.runtime import distributed
from tests.helpers import EXACT, TINY, float64_default


def _count(counter, fn):
    def counted(*args, **kwargs):
        counter[0] += 1
        return fn(*args, **kwargs)

    return counted


def _two_steps(cfg):
    """Two steps on each rank's synthetic batch, in float64 (see EXACT);
    (reductions per step, the path of the whole model's weights)."""
    with float64_default():
        return _two_float64_steps(cfg)


def _two_float64_steps(cfg):
    seed_everything(0)
    parts = build_components(cfg, loaders=False)
    per_rank = cfg.TRAIN.BATCH_SIZE // distributed.world_size()
    inputs, targets = timing.synthetic_batch(parts, per_rank, cfg.TRAIN.IM_SIZE)
    inputs = inputs.double() + distributed.rank()  # the ranks' batches differ
    counter = [0]
    if cfg.FSDP.ENABLED:  # FSDP2 reduce-scatters each block's gradients
        dist.reduce_scatter_single = _count(counter, dist.reduce_scatter_single)
    else:  # DDP all-reduces its gradient buckets, through a comm hook
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        def hook(state, bucket):
            counter[0] += 1
            return default_hooks.allreduce_hook(state, bucket)

        parts.trained.register_comm_hook(None, hook)
    for _ in range(2):
        train_step(parts, inputs, targets)
    # The whole model's weights (every rank's shards gathered under FSDP) to a
    # file: a big result would not fit through the launcher's result queue.
    state = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
             for k, v in parts.model.state_dict().items()}  # fmt: skip
    path = os.path.join(cfg.OUT_DIR, f"rank{distributed.rank()}.pt")
    torch.save(state, path)
    return counter[0] / 2, path


@pytest.mark.parametrize("fsdp", ["False", "True"])
def test_accumulated_steps_match_the_whole_batch_with_one_reduction(fsdp, tmp_path):
    opts = [
        *TINY, "NUM_GPUS", "2", "TRAIN.BATCH_SIZE", "16", "TEST.BATCH_SIZE", "16",
        "FSDP.ENABLED", fsdp, "OPTIM.OPTIMIZER", "sgd", "OPTIM.BASE_LR", "0.5",
    ]  # fmt: skip
    (tmp_path / "whole").mkdir()
    (tmp_path / "accum").mkdir()
    whole_syncs, whole = launch.launch(
        _two_steps, load_cfg(None, [*opts, "OUT_DIR", str(tmp_path / "whole")])
    )
    syncs, state = launch.launch(
        _two_steps,
        load_cfg(
            None, [*opts, "OUT_DIR", str(tmp_path / "accum"), "TRAIN.ACCUM_STEPS", "4"]
        ),  # fmt: skip
    )
    whole, state = torch.load(whole), torch.load(state)
    assert whole_syncs > 0
    assert syncs == whole_syncs  # not 4x: no reduction on the inner micro-batches
    # The whole model on both sides (not one rank's shards), equal as float64 sums
    # in another order are.
    shapes = {
        k: v.shape for k, v in build_model(load_cfg(None, opts)).state_dict().items()
    }
    assert {k: v.shape for k, v in state.items()} == shapes
    assert {k: v.shape for k, v in whole.items()} == shapes
    for key, value in state.items():
        assert value.dtype == torch.float64, key
        torch.testing.assert_close(value, whole[key], **EXACT)
