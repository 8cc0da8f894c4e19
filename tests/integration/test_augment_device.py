"""TRAIN.AUGMENT_BACKEND device in a real run: DeiT's RandAugment on the batch after its
copy (the decoding threads crop and flip only) learns the digits demo as the host's
tensor ops do, and a resumed run repeats its draws exactly (op-level equality with
Pillow: tests/unit/datasets/to_device/test_augment_policy.py)."""

import os
import shutil

import pytest

from pycls_fast.observe.logging import load_json_stats
from tests.helpers import (
    DIGITS_CFG,
    chance_error_bound,
    digits_opts,
    held_out_images,
    one_thread_env,
    run_tool,
    sampling_band,
)

pytestmark = pytest.mark.slow

# The shrunk demo (digits_opts) with DeiT's policy, a checkpoint every epoch.
OPTS = [
    "TRAIN.AUGMENT", "rand-m9-mstd0.5-inc1", "TRAIN.AUGMENT_INTERPOLATION", "bicubic",
    "OPTIM.MAX_EPOCH", "6", "OPTIM.WARMUP_EPOCHS", "1", "TRAIN.CHECKPOINT_PERIOD", "1",
    "LOG_PERIOD", "1",
]  # fmt: skip


def _run(digits, out, *opts):
    args = ["--cfg", DIGITS_CFG, *digits_opts(digits, out, *OPTS, *opts)]
    result = run_tool("train_net.py", *args, timeout=600, env=one_thread_env())
    assert result.returncode == 0, result.stderr[-3000:]
    return load_json_stats(os.path.join(out, "stdout.log"))


def _losses(records, epoch):
    return [
        r["loss"]
        for r in records
        if r["_type"] == "train_iter" and r["epoch"].startswith(f"{epoch}/")
    ]


def _error(records):
    return [r for r in records if r["_type"] == "test_epoch"][-1]["top1_err"]


def test_device_randaugment_learns_as_the_host_one_and_resumes_exactly(
    digits, tmp_path
):
    """Both backends learn (below chance by 5 standard errors) and their test
    errors differ by less than two independent estimates of one error may (5
    standard errors of a difference, p = 0.5's worst case); they draw from other
    generators, so their losses differ. Resumed from its epoch-5 checkpoint, the
    device run repeats its last epoch loss for loss."""
    host = _run(digits, tmp_path / "host", "TRAIN.AUGMENT_BACKEND", "tensor")
    device = _run(digits, tmp_path / "device", "TRAIN.AUGMENT_BACKEND", "device")
    n = held_out_images(digits)
    chance = chance_error_bound(10, n)
    assert _error(host) < chance and _error(device) < chance
    assert abs(_error(host) - _error(device)) <= 100 * sampling_band(n, 0.5**0.5)
    assert _losses(host, 1) != _losses(device, 1)

    resumed = tmp_path / "resumed"
    name = "model_epoch_0005.pyth"
    os.makedirs(resumed / "checkpoints")
    shutil.copy(tmp_path / "device" / "checkpoints" / name, resumed / "checkpoints")
    again = _run(digits, resumed, "TRAIN.AUGMENT_BACKEND", "device")
    assert _losses(again, 6) == _losses(device, 6) and _losses(again, 5) == []
