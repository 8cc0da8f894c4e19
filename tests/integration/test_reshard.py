"""Checkpoints of tensor- and pipeline-parallel runs resume at other layouts (one
process, FSDP, TP, PP) and the reverse, ending as the uninterrupted run does
(digits, 2 gloo processes)."""

import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT, one_image_pct
from tests.integration.test_distributed import (
    FP32,
    FP32_R,
    TEST_NET,
    TRAIN_NET,
    _final_test,
    _keep,
    _losses,
    _run,
    _tolerance,
    _train,
)

pytestmark = pytest.mark.slow


def test_checkpoints_reshard_across_tp_pp_fsdp_and_one_process(digits, tmp_path):
    common = [
        "OPTIM.MAX_EPOCH", "2", "TRAIN.CHECKPOINT_ITER_PERIOD", "5", *FP32,
        "OPTIM.EMA_ALPHA", "0.05", "OPTIM.EMA_UPDATE_PERIOD", "1",
    ]  # fmt: skip
    tp2 = ["NUM_GPUS", "2", "PARALLEL.TP", "2"]
    full_dir = tmp_path / "tp2"
    full = _train(digits, full_dir, *common, *tp2)
    with open(full_dir / "stdout.log") as f:
        assert "tensor parallel over 2 ranks, sequence parallel True" in f.read()
    target = _final_test(full)
    mid = "model_epoch_0002_iter_000005.dcp"
    # Each rank wrote its own part, attn_proj as pieces in pycls's q/k/v order.
    parts = os.listdir(full_dir / "checkpoints" / mid)
    assert sorted(p for p in parts if p.endswith(".distcp")) == [
        "__0_0.distcp",
        "__1_0.distcp",
    ]

    # TP2 -> one process without FSDP (it then writes single-file checkpoints).
    one_dir = tmp_path / "one"
    _keep(full_dir, one_dir, [mid])
    one = _train(digits, one_dir, *common, "NUM_GPUS", "1")
    assert len(_losses(one)) == 6  # iterations 6..11 of epoch 2
    assert any(n.endswith(".pyth") for n in os.listdir(one_dir / "checkpoints"))
    # A single-file checkpoint met by a tensor-parallel run: one line, exit 2.
    wrong = _run(TRAIN_NET, digits, one_dir, *common, *tp2)
    assert wrong.returncode == 2, wrong.stderr[-2000:]
    assert "is one file, written without FSDP, TP or PP" in wrong.stderr
    assert "Traceback" not in wrong.stderr
    # TP2 -> FSDP over 2 processes, then its iteration-10 checkpoint -> TP2.
    fsdp_dir = tmp_path / "fsdp"
    _keep(full_dir, fsdp_dir, [mid])
    fsdp = _train(digits, fsdp_dir, *common, "NUM_GPUS", "2", "FSDP.ENABLED", "True")
    back_dir = tmp_path / "back"
    _keep(fsdp_dir, back_dir, ["model_epoch_0002_iter_000010.dcp"])
    back = _train(digits, back_dir, *common, *tp2)
    assert len(_losses(back)) == 1
    # TP2 -> a 2-stage pipeline, then its iteration-10 checkpoint -> one process.
    pp_dir = tmp_path / "pp"
    _keep(full_dir, pp_dir, [mid])
    pp = _train(digits, pp_dir, *common, "NUM_GPUS", "2", "PARALLEL.PP", "2")
    with open(pp_dir / "stdout.log") as f:
        assert "pipeline: 2 stages (1f1b), blocks stage 0: 0-0" in f.read()
    last_dir = tmp_path / "last"
    _keep(pp_dir, last_dir, ["model_epoch_0002_iter_000010.dcp"])
    last = _train(digits, last_dir, *common, "NUM_GPUS", "1")
    assert len(_losses(last)) == 1
    tol = _tolerance(full, FP32_R)
    for resumed in (one, fsdp, back, pp, last):
        test = _final_test(resumed)
        assert abs(test["loss"] - target["loss"]) <= tol
        # At most one held-out image decided otherwise.
        assert abs(test["top1_err"] - target["top1_err"]) <= one_image_pct(digits)
    # A TP2 checkpoint consolidates into one file (pycls's q/k/v order) that
    # test_net reads as it reads the sharded directory.
    ckpt = str(full_dir / "checkpoints" / "model_epoch_0002.dcp")
    single = str(tmp_path / "tp2.pyth")
    tool = os.path.join(ROOT, "tools/consolidate_checkpoint.py")
    done = subprocess.run([sys.executable, tool, ckpt, single], capture_output=True)
    assert done.returncode == 0, done.stderr
    for weights in (ckpt, single):
        tested = _run(TEST_NET, digits, tmp_path / "t", *FP32, "TEST.WEIGHTS", weights)
        assert tested.returncode == 0, tested.stderr[-2000:]
        expected = f"top-1 accuracy: {100.0 - target['top1_err']:.2f}%"
        assert expected in tested.stdout
    ema = [r for r in full if r["_type"] == "test_ema_epoch"][-1]
    ema_back = [r for r in back if r["_type"] == "test_ema_epoch"][-1]
    assert abs(ema["loss"] - ema_back["loss"]) <= tol
