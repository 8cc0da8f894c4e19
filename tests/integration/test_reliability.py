"""Faults that must lose nothing, driven for real: signals sent to real training
processes, SIGKILL at random moments, a full disk, a second training into the same
OUT_DIR. Run the group alone with `pytest -m reliability`."""

import errno
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from pycls_fast import checkpoint as ckpt
from pycls_fast.config import load_cfg
from pycls_fast.engine.trainer import train_model
from pycls_fast.errors import UserError
from pycls_fast.observe.logging import load_json_stats
from pycls_fast.runtime.run_lock import OutDirInUseError, RunLock
from tests.helpers import (
    DIGITS_CFG,
    ROOT,
    digits_opts,
    one_thread_env,
    tool_command,
    wait_for_iterations,
)

pytestmark = [pytest.mark.reliability, pytest.mark.slow]

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]


def _opts(digits, out_dir, *extra):
    """The demo config at 16 px, 2 blocks: 11 iterations an epoch, 2 epochs, with
    mixup, label smoothing and drop path so that every random stream matters."""
    return digits_opts(
        digits, out_dir, "OPTIM.MAX_EPOCH", "2", "OPTIM.WARMUP_EPOCHS", "1",
        "TRAIN.MIXUP_ALPHA", "0.2", "TRAIN.LABEL_SMOOTHING", "0.1",
        "VIT.DROP_PATH", "0.1", "LOG_PERIOD", "1", "DATA_LOADER.NUM_WORKERS", "2",
        *extra,
    )  # fmt: skip


def _start(digits, out_dir, *extra, launcher=None):
    args = ["--cfg", DIGITS_CFG, *_opts(digits, out_dir, *extra)]
    return subprocess.Popen(
        tool_command("train_net.py", *args, launcher=launcher or ()),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=one_thread_env(),
        cwd=ROOT,
        start_new_session=True,  # signals go where the test sends them, nowhere else
    )


def _finish(proc, timeout=300):
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def _train(digits, out_dir, *extra, launcher=None):
    code, out, err = _finish(_start(digits, out_dir, *extra, launcher=launcher))
    assert code == 0, err[-3000:]
    return out


def _final_state(out_dir):
    path = os.path.join(out_dir, "checkpoints", "model_epoch_0002.pyth")
    return torch.load(path, map_location="cpu", weights_only=False)


def _assert_same_run(out_a, out_b):
    """Same final weights, bit for bit, and the same final test metrics."""
    a, b = _final_state(out_a), _final_state(out_b)
    for key in a["model_state"]:
        assert torch.equal(a["model_state"][key], b["model_state"][key]), key
    tests = [
        [
            r
            for r in load_json_stats(os.path.join(d, "stdout.log"))
            if r["_type"] == "test_epoch"
        ]
        for d in (out_a, out_b)
    ]
    for key in ("loss", "top1_err", "top5_err"):
        assert tests[0][-1][key] == tests[1][-1][key], key


@pytest.fixture(scope="module")
def uninterrupted(digits, tmp_path_factory):
    """The reference: the same training, never interrupted."""
    out = tmp_path_factory.mktemp("uninterrupted")
    _train(digits, out)
    return str(out)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["TERM", "INT"])
def test_signal_checkpoints_and_the_rerun_ends_identically(
    digits, tmp_path, uninterrupted, sig
):
    proc = _start(digits, tmp_path)
    wait_for_iterations(tmp_path, 3)
    proc.send_signal(sig)
    code, _, err = _finish(proc)
    assert code == 128 + sig, err[-3000:]
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"stopped by {signal.Signals(sig).name} at epoch 1")
    assert "rerun the same command to resume" in line and "Traceback" not in err
    newest = ckpt.last_checkpoint(str(tmp_path))
    assert newest is not None and "_iter_" in newest  # mid-epoch, not epoch end
    # Rerunning the same command resumes there and ends exactly as if never stopped:
    # same weights bit for bit (so the same data order, crops, mixup and drop path).
    _train(digits, tmp_path)
    assert f"resumed from {newest}" in (tmp_path / "stdout.log").read_text()
    _assert_same_run(uninterrupted, str(tmp_path))


@pytest.mark.parametrize("how", ["torchrun", "NUM_GPUS"])
def test_sigterm_to_a_multi_process_job_checkpoints_every_rank(digits, tmp_path, how):
    if how == "torchrun":  # FSDP: every rank writes its shard
        launcher, opts = [*TORCHRUN, "--nproc_per_node", "2"], ["FSDP.ENABLED", "True"]
    else:  # DDP, ranks spawned by train_net itself
        launcher, opts = None, ["NUM_GPUS", "2"]
    proc = _start(digits, tmp_path, *opts, launcher=launcher)
    wait_for_iterations(tmp_path, 3)
    proc.send_signal(signal.SIGTERM)  # to the launcher, which passes it to the ranks
    code, _, err = _finish(proc)
    assert code != 0
    assert "stopped by SIGTERM at epoch 1" in err, err[-3000:]
    newest = ckpt.last_checkpoint(str(tmp_path))
    assert newest is not None and "_iter_" in newest
    if how == "torchrun":
        files = os.listdir(newest)
        assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= set(files)
    else:
        assert code == 128 + signal.SIGTERM
        # Both ranks' random streams are in the one file.
        assert len(ckpt.load_checkpoint(newest)["rank_states"]) == 2
    _train(digits, tmp_path, *opts, launcher=launcher)
    log = (tmp_path / "stdout.log").read_text()
    assert f"resumed from {newest}" in log
    assert [r["epoch"] for r in load_json_stats(tmp_path / "stdout.log")][-1] == "2/2"


def _iteration_of(path):
    name = os.path.basename(path)
    epoch = int(name[len("model_epoch_") :][:4])
    if "_iter_" not in name:
        return epoch * 11
    return (epoch - 1) * 11 + int(name.split("_iter_")[1][:6])


def test_sigkill_at_random_moments_loses_at_most_one_period(
    digits, tmp_path, uninterrupted
):
    # A checkpoint after every iteration: a kill lands mid-write often.
    opts = ["TRAIN.CHECKPOINT_ITER_PERIOD", "1"]
    rng = random.Random(0)
    for kill in range(3):
        proc = _start(digits, tmp_path, *opts)
        wait_for_iterations(tmp_path, 2 + 3 * kill)
        time.sleep(rng.uniform(0.0, 0.5))
        os.killpg(proc.pid, signal.SIGKILL)
        _finish(proc)
        logged = [
            r
            for r in load_json_stats(tmp_path / "stdout.log")
            if r["_type"] == "train_iter"
        ]
        last = logged[-1]
        done = (int(last["epoch"].split("/")[0]) - 1) * 11 + int(
            last["iter"].split("/")[0]
        )
        newest = ckpt.last_checkpoint(str(tmp_path))
        # Every listed checkpoint is complete, and at most one period (1 iteration)
        # of what the log shows as done is lost.
        for path in ckpt.list_checkpoints(str(tmp_path)):
            assert "model_state" in ckpt.load_checkpoint(path)
        assert _iteration_of(newest) >= done - 1, (newest, last)
    # A write cut short, as a kill mid-write leaves it: never picked up, removed.
    folder = tmp_path / "checkpoints"
    partial = folder / "model_epoch_0002_iter_000010.pyth.tmp.99999"
    partial.write_bytes(b"\x80\x02 half a checkpoint")
    (folder / "model_epoch_0002_iter_000011.dcp.tmp").mkdir()
    assert ".tmp" not in os.path.basename(ckpt.last_checkpoint(str(tmp_path)))
    _train(digits, tmp_path, *opts)
    assert not partial.exists()
    assert not (folder / "model_epoch_0002_iter_000011.dcp.tmp").exists()
    _assert_same_run(uninterrupted, str(tmp_path))


def test_a_failed_checkpoint_write_stops_and_keeps_the_previous(
    digits, tmp_path, monkeypatch
):
    cfg = load_cfg(
        DIGITS_CFG,
        _opts(digits, tmp_path, "TRAIN.CHECKPOINT_ITER_PERIOD", "3", "LOG_PERIOD", "5"),
    )
    real_save = torch.save
    calls = []

    def disk_full_on_second_write(obj, f, *args, **kwargs):
        calls.append(f)
        if len(calls) == 2:
            f.write(b"\x80\x02 the first bytes")  # a write cut short by ENOSPC
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", disk_full_on_second_write)
    with pytest.raises(UserError) as e:
        train_model(cfg)
    message = str(e.value)
    assert "cannot write a checkpoint" in message and "No space left" in message
    assert "the previous checkpoints are intact" in message
    names = sorted(os.listdir(tmp_path / "checkpoints"))
    assert names == ["model_epoch_0001_iter_000003.pyth"]  # no half-written file
    state = ckpt.load_checkpoint(str(tmp_path / "checkpoints" / names[0]))
    assert state["iter"] == 3
    # The run stopped there: nothing was trained without a safety net.
    iters = [
        r
        for r in load_json_stats(tmp_path / "stdout.log")
        if r["_type"] == "train_iter"
    ]
    assert [r["iter"] for r in iters] == ["5/11"]


def test_two_trainings_into_one_out_dir_are_refused(digits, tmp_path):
    first = _start(digits, tmp_path, "OPTIM.MAX_EPOCH", "50")
    try:
        wait_for_iterations(tmp_path, 1)
        log_before = (tmp_path / "stdout.log").read_text()
        second = _start(digits, tmp_path, "OPTIM.MAX_EPOCH", "50")
        code, _, err = _finish(second, timeout=120)
        assert code == 2
        assert len(err.strip().splitlines()) == 1, err
        assert (
            f"OUT_DIR {tmp_path} is in use by another training (pid {first.pid}" in err
        )
        # The refused run wrote nothing into the running one's log.
        assert (tmp_path / "stdout.log").read_text().startswith(log_before)
        assert "in use" not in (tmp_path / "stdout.log").read_text()
        assert first.poll() is None  # the first one trains on
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.communicate()
    # A killed training leaves no stale lock behind.
    lock, again = RunLock(str(tmp_path)), RunLock(str(tmp_path))
    with lock, pytest.raises(OutDirInUseError), again:
        pass
