"""checkpoint/averaging.py on small state dicts: the float64 mean in each tensor's
dtype, the EMA only when all have one, the last K and best K choices."""

import json
import os

import pytest
import torch

from pycls_fast.checkpoint.averaging import (
    average_checkpoints,
    best_checkpoints,
    last_checkpoints,
)
from pycls_fast.checkpoint.files import save_checkpoint
from pycls_fast.errors import CheckpointError


def _state(seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(4, 3, generator=g).to(dtype),
        "count": torch.tensor([7]),
    }


def _write(out, epoch, seed, ema=True, dtype=torch.float32):
    state = {"model_state": _state(seed, dtype), "epoch": epoch, "cfg": f"E{epoch}"}
    if ema:
        state["ema_state"] = _state(seed + 100, dtype)
    return save_checkpoint(str(out), state, epoch)


def test_mean_in_float64_stored_in_each_dtype(tmp_path):
    paths = [_write(tmp_path, e, e, dtype=torch.bfloat16) for e in (1, 2, 3)]
    meta = average_checkpoints(paths, str(tmp_path / "avg.pyth"))
    avg = torch.load(tmp_path / "avg.pyth", weights_only=True)
    states = [_state(s, torch.bfloat16) for s in (1, 2, 3)]
    # bf16 sums would round at each step; float64 rounds once, at the end.
    expected = (sum(s["w"].double() for s in states) / 3).to(torch.bfloat16)
    assert avg["model_state"]["w"].dtype == torch.bfloat16
    assert torch.equal(avg["model_state"]["w"], expected)
    assert torch.equal(avg["model_state"]["count"], torch.tensor([7]))
    emas = [_state(s + 100, torch.bfloat16)["w"].double() for s in (1, 2, 3)]
    assert torch.equal(avg["ema_state"]["w"], (sum(emas) / 3).to(torch.bfloat16))
    assert meta["epoch"] == 3 and meta["cfg"] == "E3"
    assert meta["averaged"] == [os.path.basename(p) for p in paths]


def test_ema_left_out_unless_every_checkpoint_has_one(tmp_path):
    paths = [_write(tmp_path, 1, 1), _write(tmp_path, 2, 2, ema=False)]
    average_checkpoints(paths, str(tmp_path / "avg.pyth"))
    assert "ema_state" not in torch.load(tmp_path / "avg.pyth", weights_only=True)


def test_unlike_checkpoints_are_refused(tmp_path):
    a = _write(tmp_path, 1, 1)
    other = {"model_state": {"w": torch.zeros(4, 4), "count": torch.tensor([7])}}
    b = save_checkpoint(str(tmp_path), other, 2)
    with pytest.raises(CheckpointError, match="has shape"):
        average_checkpoints([a, b], str(tmp_path / "avg.pyth"))
    odd = {"model_state": {"w": torch.zeros(4, 3), "count": torch.tensor([8])}}
    c = save_checkpoint(str(tmp_path), odd, 3)
    with pytest.raises(CheckpointError, match="integer tensor count differs"):
        average_checkpoints([a, c], str(tmp_path / "avg.pyth"))


def test_last_and_best_k(tmp_path):
    for e in (1, 2, 3, 4):
        _write(tmp_path, e, e)
    errors = {1: 50.0, 2: 30.0, 3: 40.0, 4: 30.0}
    with open(tmp_path / "stdout.log", "w") as f:
        for e, err in errors.items():
            record = {"_type": "test_epoch", "epoch": f"{e}/4", "top1_err": err}
            f.write(f"json_stats: {json.dumps(record)}\n")
        # A resumed run repeats epoch 1: its last record counts.
        record = {"_type": "test_epoch", "epoch": "1/4", "top1_err": 10.0}
        f.write(f"json_stats: {json.dumps(record)}\n")
    names = [os.path.basename(p) for p in last_checkpoints(str(tmp_path), 2)]
    assert names == ["model_epoch_0003.pyth", "model_epoch_0004.pyth"]
    best = [os.path.basename(p) for p in best_checkpoints(str(tmp_path), 2)]
    assert best == ["model_epoch_0001.pyth", "model_epoch_0004.pyth"]  # ties: newer
    with pytest.raises(CheckpointError, match="fewer than the 5"):
        best_checkpoints(str(tmp_path), 5)
