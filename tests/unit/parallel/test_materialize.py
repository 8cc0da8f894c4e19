"""parallel/materialize.py in one process: a meta model filled tensor by tensor is
the CPU model, nothing is left unfilled, and weights read per tensor (a sharded
checkpoint's) are the file's."""

import pytest
import torch
import torch.distributed.checkpoint as dcp

from pycls_fast.checkpoint import sharded
from pycls_fast.checkpoint.sharded import CheckpointTensors
from pycls_fast.checkpoint.weights import load_model_weights
from pycls_fast.models import build_model
from pycls_fast.models.vit import init_tensor
from pycls_fast.parallel.materialize import full_init, is_meta, materialize
from tests.helpers import tiny_cfg


def _meta(cfg):
    with torch.device("meta"):
        return build_model(cfg)


@pytest.mark.parametrize(
    "extra", [[], ["VIT.QK_NORM", "True", "VIT.CLASSIFIER_TYPE", "pooled"]]
)
def test_meta_model_filled_per_tensor_is_build_models(extra):
    cfg = tiny_cfg("VIT.LAYER_SCALE", "0.1", *extra)
    torch.manual_seed(3)
    whole = build_model(cfg)
    torch.manual_seed(3)
    model = _meta(cfg)
    assert is_meta(model)
    init = full_init(
        lambda name, t: init_tensor(model.params, name, t, model.init_seed)
    )
    materialize(model, torch.device("cpu"), init)
    assert not is_meta(model)
    for (name, a), (_, b) in zip(
        model.state_dict().items(), whole.state_dict().items()
    ):
        assert torch.equal(a, b), name


def test_a_tensor_without_a_value_is_named():
    model = _meta(tiny_cfg())

    def init(name, t):
        return None if name == "pos_embedding" else torch.zeros(tuple(t.shape))

    with pytest.raises(ValueError, match="pos_embedding"):
        materialize(model, torch.device("cpu"), init)


def test_sharded_checkpoint_weights_are_read_one_tensor_at_a_time(tmp_path):
    """A DCP checkpoint's model state read per tensor (CheckpointTensors) loads the
    same values as the state itself, one dcp.load per tensor asked for."""
    cfg = tiny_cfg()
    torch.manual_seed(0)
    trained = build_model(cfg)
    saved = trained.state_dict()
    path = str(tmp_path / "model_epoch_0001.dcp")
    optimizer = torch.optim.SGD(trained.parameters(), lr=0.1)
    sharded.save(path, trained, optimizer, None, {"epoch": 1}, {})
    tensors = CheckpointTensors(path)
    assert set(tensors) == set(saved)
    assert tensors.shape("pos_embedding") == tuple(saved["pos_embedding"].shape)
    calls = []
    original = dcp.load

    def counting(state, **kw):
        calls.append(state)
        return original(state, **kw)

    dcp.load, load = counting, dcp.load
    try:
        torch.manual_seed(1)
        model = build_model(cfg)
        # load_model_weights reads the meta of the checkpoint too (one more call).
        loaded = load_model_weights(model, path)
    finally:
        dcp.load = load
    tensor_calls = [s for s in calls if "model" in s]
    assert all(len(s["model"]) == 1 for s in tensor_calls)
    # Each once; the position embedding also once before, to compare its grid.
    assert len(tensor_calls) == len(saved) + 1
    assert (loaded.epoch, loaded.matched) == (1, len(saved))
    for name, value in model.state_dict().items():
        assert torch.equal(value, saved[name]), name
