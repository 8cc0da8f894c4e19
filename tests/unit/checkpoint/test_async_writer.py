"""Asynchronous checkpoints (TRAIN.CHECKPOINT_ASYNC): what is written is the state at
the save, a new save waits for the previous write, the run's end waits for its last,
retention follows completed writes, and a kill mid-write leaves the previous
checkpoint as the newest complete one."""

import os
import signal
import subprocess
import sys
import time

import torch

from pycls_fast.checkpoint import CheckpointManager, files
from pycls_fast.checkpoint.async_writer import FileWrite, HostStager
from pycls_fast.engine.trainer import build_components
from tests.helpers import ROOT, tiny_cfg


def test_the_staged_state_is_the_state_at_the_save(tmp_path):
    weights = torch.arange(12.0).reshape(3, 4)
    state = {"model_state": {"w": weights, "nested": [weights[0], (weights[1],)]},
             "epoch": 3}  # fmt: skip
    staged = HostStager().stage(state)
    before = weights.clone()
    weights.add_(100.0)  # training goes on while the write runs
    write = FileWrite(lambda s: files.save_checkpoint(str(tmp_path), s, 3), staged)
    path = write.wait()
    loaded = files.load_checkpoint(path)
    assert torch.equal(loaded["model_state"]["w"], before)
    assert torch.equal(loaded["model_state"]["nested"][1][0], before[1])
    assert loaded["epoch"] == 3


def test_a_state_staged_by_the_writer_is_the_state_at_the_save(tmp_path):
    # On a CPU the writer thread copies the state itself; training waits for the
    # copy (wait_staged) before its optimizer step changes the weights.
    weights = torch.arange(10_000_000, dtype=torch.float32)
    before = weights.clone()

    def write(staged):
        return files.save_checkpoint(str(tmp_path), staged, 1)

    write_ = FileWrite(write, {"model_state": {"w": weights}}, HostStager().stage)
    write_.wait_staged()
    weights.add_(1.0)  # the optimizer step
    loaded = files.load_checkpoint(write_.wait())
    assert torch.equal(loaded["model_state"]["w"], before)


def test_a_failed_write_is_raised_by_wait(tmp_path):
    def fail(_):
        raise OSError(28, "No space left on device")

    write = FileWrite(fail)
    try:
        write.wait()
    except OSError as e:
        assert e.errno == 28
    else:
        raise AssertionError("the write's error was not raised")


def _parts(out_dir, *opts):
    cfg = tiny_cfg("OUT_DIR", str(out_dir), "TRAIN.CHECKPOINT_ASYNC", "True", *opts)
    return build_components(cfg, loaders=())


def test_saves_wait_for_the_previous_and_retention_follows_the_write(tmp_path):
    parts = _parts(tmp_path, "TRAIN.CHECKPOINT_KEEP", "1")
    manager = CheckpointManager(parts)
    first = next(iter(parts.model.parameters()))
    at_first = first.detach().clone()
    assert manager.save(1, 0) is None  # staged; written beside training
    manager.wait_staged()  # what train_step does before the optimizer step
    with torch.no_grad():
        first.add_(1.0)
    manager.save(2, 0)
    # The second save completed the first before it began: the first is on disk,
    # and retention (keep 1) waits for the second to be complete.
    names = [os.path.basename(p) for p in files.list_checkpoints(str(tmp_path))]
    assert "model_epoch_0001.pyth" in names
    manager.close()
    names = [os.path.basename(p) for p in files.list_checkpoints(str(tmp_path))]
    assert names == ["model_epoch_0002.pyth"]
    assert manager.pending is None
    saved = files.load_checkpoint(files.last_checkpoint(str(tmp_path)))
    name = next(n for n, p in parts.model.named_parameters() if p is first)
    assert torch.equal(saved["model_state"][name], at_first + 1.0)


# A child process: checkpoint 1 written synchronously, then checkpoint 2 (~300 MB)
# staged and written by the writer thread; it prints "started" and waits.
_CHILD = """
import sys, time, torch
from pycls_fast.checkpoint import files
from pycls_fast.checkpoint.async_writer import FileWrite, HostStager
out = sys.argv[1]
files.save_checkpoint(out, {"model_state": {"w": torch.zeros(4)}}, 1)
big = {"model_state": {"w": torch.ones(75_000_000)}}
staged = HostStager().stage(big)
FileWrite(lambda s: files.save_checkpoint(out, s, 2), staged)
print("started", flush=True)
time.sleep(60)
"""


def test_a_kill_during_the_write_leaves_the_previous_checkpoint(tmp_path):
    env = {**os.environ, "PYTHONPATH": ROOT}
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    folder = files.checkpoint_dir(str(tmp_path))
    try:
        assert child.stdout.readline().strip() == "started"
        deadline = time.monotonic() + 60
        while not any(".tmp." in n for n in os.listdir(folder)):
            assert time.monotonic() < deadline, "the write never started"
            time.sleep(0.001)
        os.kill(child.pid, signal.SIGKILL)  # mid-write: the temporary file exists
    finally:
        child.kill()
        child.wait()
    assert [os.path.basename(p) for p in files.list_checkpoints(str(tmp_path))] == [
        "model_epoch_0001.pyth"
    ]
    # The next start clears what the write left; checkpoint 1 is the one resumed.
    assert files.remove_partial(str(tmp_path))
    assert sorted(os.listdir(folder)) == ["model_epoch_0001.pyth"]
    assert files.last_checkpoint(str(tmp_path)).endswith("model_epoch_0001.pyth")
