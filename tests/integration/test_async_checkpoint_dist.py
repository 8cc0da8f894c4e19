"""Asynchronous sharded checkpoints under FSDP (2 gloo processes): DCP's async_save
beside training, published (renamed complete) only once every rank's write is done;
a job killed (SIGKILL) with writes in flight resumes from a complete checkpoint and
ends as the uninterrupted synchronous job."""

import os
import signal
import subprocess
import sys

import pytest

from pycls_fast.checkpoint import files as ckpt
from pycls_fast.observe.logging import load_json_stats
from tests.helpers import DIGITS_CFG, ROOT, one_thread_env, wait_for_iterations
from tests.integration.test_distributed import FP32, _final_test, _opts, _train

pytestmark = pytest.mark.slow

TRAIN_NET = os.path.join(ROOT, "tools/train_net.py")
# The same layout, the same steps: the resumed job computes what the uninterrupted
# one did; json_stats prints 6 significant digits of a loss of about 2.
FP32_TOL = 1e-4

COMMON = ["FSDP.ENABLED", "True", "NUM_GPUS", "2", *FP32]


def test_fsdp_async_checkpoints_survive_a_kill_and_end_as_sync(digits, tmp_path):
    reference = _final_test(_train(digits, tmp_path / "sync", *COMMON))
    out = tmp_path / "async"
    # A checkpoint after every step: a kill lands while a write is in flight.
    opts = [*COMMON, "TRAIN.CHECKPOINT_ASYNC", "True",
            "TRAIN.CHECKPOINT_ITER_PERIOD", "1"]  # fmt: skip
    cmd = [sys.executable, TRAIN_NET, "--cfg", DIGITS_CFG, *_opts(digits, out, *opts)]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=one_thread_env(),
        cwd=ROOT,
        start_new_session=True,
    )
    try:
        wait_for_iterations(out, 5)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    listed = ckpt.list_checkpoints(str(out))
    assert listed, "no complete checkpoint after 5 steps"
    for path in listed:  # every listed one is complete: every rank's shard
        names = set(os.listdir(path))
        assert {".metadata", "__0_0.distcp", "__1_0.distcp"} <= names, path
    newest = listed[-1]
    records = _train(digits, out, *opts)
    assert f"resumed from {newest}" in (out / "stdout.log").read_text()
    assert abs(_final_test(records)["loss"] - reference["loss"]) <= FP32_TOL
    assert _final_test(records)["top1_err"] == reference["top1_err"]
    # The job's end waited for its last write: complete, and nothing left over.
    folder = os.path.join(str(out), "checkpoints")
    assert not [n for n in os.listdir(folder) if ".tmp" in n]
    assert ckpt.last_checkpoint(str(out)).endswith("model_epoch_0001.dcp")
    assert load_json_stats(out / "stdout.log")[-1]["_type"] == "goodput"
