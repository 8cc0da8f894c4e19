"""Loading a checkpoint never runs code from it: files and sharded blobs are read
with weights_only, and whatever would run code is refused with one clear line."""

import io
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from pycls_fast.checkpoint import files, sharded
from pycls_fast.engine import trainer
from pycls_fast.errors import CheckpointError
from tests.helpers import DIGITS_CFG, ROOT, digits_cfg


class _Planted:
    """Unpickling it opens (creates) `path`: what a hostile checkpoint could do."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def _plant(path, marker):
    torch.save({"model_state": {}, "epoch": 1, "x": _Planted(marker)}, str(path))


def test_the_planted_payload_runs_without_weights_only(tmp_path):
    # The test's own check: loading it the unsafe way does create the file.
    _plant(tmp_path / "evil.pyth", tmp_path / "marker")
    torch.load(tmp_path / "evil.pyth", weights_only=False)
    assert (tmp_path / "marker").exists()


def test_load_checkpoint_refuses_code(tmp_path):
    marker = tmp_path / "marker"
    _plant(tmp_path / "evil.pyth", marker)
    with pytest.raises(CheckpointError, match="run code for .*open"):
        files.load_checkpoint(str(tmp_path / "evil.pyth"))
    buf = io.BytesIO()
    torch.save({"x": _Planted(marker)}, buf)
    with pytest.raises(CheckpointError, match="run code"):
        sharded._unblob(buf, "some.dcp")  # the meta and RNG blobs of DCP
    assert not marker.exists()


def test_checkpoints_of_numpy_rng_states_are_refused_clearly(tmp_path):
    # What the previous format held in rng_state: numpy's legacy state, an ndarray.
    path = tmp_path / "old.pyth"
    torch.save({"rng_state": {"numpy": np.random.get_state()}}, str(path))
    with pytest.raises(CheckpointError, match="numpy RNG states"):
        files.load_checkpoint(str(path))


def _cfg(digits, out_dir, *opts):
    # The demo's own batch sizes (64 / 200).
    return digits_cfg(
        digits, out_dir, "VIT.NUM_LAYERS", "1", "TRAIN.BATCH_SIZE", "64",
        "OPTIM.MAX_EPOCH", "1", *opts,
    )  # fmt: skip


def test_train_and_test_refuse_a_planted_checkpoint(digits, tmp_path):
    marker = tmp_path / "marker"
    evil = tmp_path / "evil.pyth"
    _plant(evil, marker)
    with pytest.raises(CheckpointError, match="run code"):
        trainer.train_model(_cfg(digits, tmp_path / "a", "TRAIN.WEIGHTS", str(evil)))
    with pytest.raises(CheckpointError, match="run code"):
        trainer.test_model(_cfg(digits, tmp_path / "b", "TEST.WEIGHTS", str(evil)))
    # Auto-resume from a planted checkpoint in OUT_DIR.
    out = tmp_path / "c"
    os.makedirs(files.checkpoint_dir(str(out)))
    _plant(
        os.path.join(files.checkpoint_dir(str(out)), "model_epoch_0001.pyth"), marker
    )
    with pytest.raises(CheckpointError, match="run code"):
        trainer.train_model(_cfg(digits, out, "OPTIM.MAX_EPOCH", "2"))
    # From the command line: one line, exit 2.
    result = subprocess.run(
        [
            sys.executable, os.path.join(ROOT, "tools", "test_net.py"),
            "--cfg", DIGITS_CFG, "DATA.PATH", digits, "OUT_DIR", str(tmp_path / "d"),
            "TRAIN.IM_SIZE", "16", "TEST.IM_SIZE", "16", "VIT.NUM_LAYERS", "1",
            "VIT.HIDDEN_DIM", "32",
            "VIT.MLP_DIM", "64", "TEST.WEIGHTS", str(evil),
        ],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "run code" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not marker.exists()
