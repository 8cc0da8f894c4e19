"""The model is built on the meta device, parallelized, then only this rank's shards
are allocated and filled (engine/model_setup.py): the same seed gives the same
whole initial weights (and EMA) at every layout, weights files load into the
shards, and a rank's memory while building is about its shard, not the model."""

import os
import resource

import pytest
import torch

from pycls_fast.config import load_cfg
from pycls_fast.engine.trainer import build_components, seed_everything
from pycls_fast.launch import processes as launch
from pycls_fast.models import build_model
from pycls_fast.parallel.tensor_parallel import canonical_state_dict, tp_size
from pycls_fast.runtime import distributed
from tests.helpers import TINY

# A conv stem (BatchNorm buffers), LayerScale, both tokens' positions: every kind
# of tensor the init fills. EMA on, to check it starts as the model's copy.
BASE = [
    *TINY, "VIT.NUM_LAYERS", "4", "VIT.STEM_TYPE", "conv",
    "VIT.C_STEM_KERNELS", "[3, 1]", "VIT.C_STEM_STRIDES", "[8, 1]",
    "VIT.C_STEM_DIMS", "[16, 48]", "VIT.LAYER_SCALE", "0.1",
    "TRAIN.BATCH_SIZE", "8", "TEST.BATCH_SIZE", "8",
    "OPTIM.EMA_ALPHA", "1e-4",
]  # fmt: skip

LAYOUTS = {
    "one": [],
    "fsdp2": ["NUM_GPUS", "2", "FSDP.ENABLED", "True"],
    "tp2": ["NUM_GPUS", "2", "PARALLEL.TP", "2"],
    "pp2": ["NUM_GPUS", "2", "PARALLEL.PP", "2"],
}


def _gathered(model):
    """The whole state this rank holds (DTensors gathered, pycls's q/k/v order)."""
    return canonical_state_dict(model, tp_size(model))


def _init_and_save(cfg):
    """Builds the components with seed 0 (and again with TEST.WEIGHTS-style
    `weights`, when WEIGHTS_FILE is set); saves what this rank holds, gathered."""
    seed_everything(0)
    parts = build_components(cfg, loaders=False)
    out = {"state": _gathered(parts.model), "ema": _gathered(parts.ema)}
    weights = os.environ.get("META_INIT_WEIGHTS")
    if weights:
        seed_everything(1)  # other initial values: loading must replace them all
        loaded = build_components(cfg, loaders=False, weights=weights)
        out["loaded"] = _gathered(loaded.model)
    path = os.path.join(cfg.OUT_DIR, f"rank{distributed.rank()}.pt")
    torch.save(out, path)


def _run(tmp_path, name, opts):
    out = tmp_path / name
    out.mkdir()
    launch.launch(_init_and_save, load_cfg(None, [*BASE, *opts, "OUT_DIR", str(out)]))
    merged: dict = {}
    for path in sorted(out.glob("rank*.pt")):
        for key, state in torch.load(path).items():
            merged.setdefault(key, {}).update(state)  # pipeline stages: disjoint
    return merged


def _assert_equal(got, want):
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert torch.equal(got[key], value), key


@pytest.fixture
def weights_file(tmp_path, monkeypatch):
    """A whole-model weights file of other values than seed 0's init."""
    torch.manual_seed(123)
    model = build_model(load_cfg(None, BASE))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))  # the zero head and ones of norms too
    path = tmp_path / "weights.pyth"
    torch.save({"model_state": model.state_dict()}, path)
    monkeypatch.setenv("META_INIT_WEIGHTS", str(path))
    return model.state_dict()


@pytest.mark.parametrize("layout", ["fsdp2", "tp2", "pp2"])
def test_same_seed_same_initial_weights_at_every_layout(layout, weights_file, tmp_path):
    """Exactly equal: every layout cuts its pieces out of the same full tensors.
    The EMA starts as the model; weights files load into the shards."""
    one = _run(tmp_path, "one", LAYOUTS["one"])
    torch.manual_seed(0)
    whole = build_model(load_cfg(None, BASE)).state_dict()
    _assert_equal(one["state"], whole)  # the trainer's init is build_model's
    got = _run(tmp_path, layout, LAYOUTS[layout])
    _assert_equal(got["state"], one["state"])
    _assert_equal(got["ema"], one["state"])
    _assert_equal(got["loaded"], weights_file)
    _assert_equal(one["loaded"], weights_file)


def test_meta_build_draws_as_a_cpu_build():
    """Built on the meta device or on the CPU, a model takes one draw of the global
    generator: what follows (data order, dropout) does not depend on it."""
    cfg = load_cfg(None, BASE)
    torch.manual_seed(0)
    cpu = build_model(cfg)
    after_cpu = torch.rand(3)
    torch.manual_seed(0)
    with torch.device("meta"):
        meta = build_model(cfg)
    assert torch.equal(torch.rand(3), after_cpu)
    assert meta.init_seed == cpu.init_seed
    assert all(p.is_meta for p in meta.parameters())
    torch.manual_seed(1)
    assert not torch.equal(build_model(cfg).pos_embedding, cpu.pos_embedding)


# A model large enough that its size stands out of a process's RSS noise (~100 MB
# in fp32), small enough to build in seconds.
FSDP2_EMA = ["OPTIM.EMA_ALPHA", "1e-4", "NUM_GPUS", "2", "FSDP.ENABLED", "True"]
BIG = [
    *TINY, "VIT.HIDDEN_DIM", "512", "VIT.NUM_HEADS", "8", "VIT.MLP_DIM", "2048",
    "VIT.NUM_LAYERS", "8", *FSDP2_EMA,
]  # fmt: skip


def _build_peak(cfg):
    """Peak RSS growth (bytes) of building the components, and the model's bytes."""
    seed_everything(0)
    # A tiny model first: what building imports and sets up once (~100 MB of
    # libraries) is not the model's.
    tiny = load_cfg(None, [*TINY, *FSDP2_EMA, "OUT_DIR", cfg.OUT_DIR])
    build_components(tiny, loaders=False)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    parts = build_components(cfg, loaders=False)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    whole = sum(p.numel() * 4 for p in parts.model.parameters())
    path = os.path.join(cfg.OUT_DIR, f"rank{distributed.rank()}.pt")
    torch.save({"grown": peak - before, "whole": whole}, path)


def test_fsdp_rank_builds_its_shard_not_the_model(tmp_path):
    """FSDP x2 with an EMA: each rank's peak memory grows by about its half of the
    model and its half of the EMA (1.0 x the model), plus the largest tensor; a
    rank that built the whole model (and copied it for the EMA) grew by 2 x or more
    before it could shard."""
    launch.launch(_build_peak, load_cfg(None, [*BIG, "OUT_DIR", str(tmp_path)]))
    for path in tmp_path.glob("rank*.pt"):
        got = torch.load(path)
        assert got["whole"] > 90e6
        assert got["grown"] < 1.5 * got["whole"], got
