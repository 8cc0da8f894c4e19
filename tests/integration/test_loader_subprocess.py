"""DATA_LOADER.MODE subprocess in real training processes: a stop signal to the whole
process group (Ctrl-C, SLURM) checkpoints and resumes to the very weights of a
'threads' run; a SIGKILLed trainer leaves no loader process and no shared memory."""

import os
import re
import signal
import subprocess
import time

import torch

from pycls_fast import checkpoint as ckpt
from tests.helpers import (
    DIGITS_CFG,
    ROOT,
    digits_opts,
    one_thread_env,
    shm_held,
    tool_command,
    wait_for_iterations,
)


def _start(digits, out_dir, mode):
    opts = digits_opts(
        digits, out_dir, "OPTIM.MAX_EPOCH", "2", "OPTIM.WARMUP_EPOCHS", "1",
        "TRAIN.MIXUP_ALPHA", "0.2", "LOG_PERIOD", "1",
        "DATA_LOADER.NUM_WORKERS", "2", "DATA_LOADER.MODE", mode,
    )  # fmt: skip
    return subprocess.Popen(
        tool_command("train_net.py", "--cfg", DIGITS_CFG, *opts),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=one_thread_env(),
        cwd=ROOT,
        start_new_session=True,  # its own process group, as a job's
    )


def _children(pid):
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def _weights(out_dir):
    path = os.path.join(out_dir, "checkpoints", "model_epoch_0002.pyth")
    return torch.load(path, map_location="cpu", weights_only=False)["model_state"]


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_group_sigterm_checkpoints_and_resumes_to_the_threads_weights(digits, tmp_path):
    threads_out, out = tmp_path / "threads", tmp_path / "subprocess"
    reference = _start(digits, threads_out, "threads")
    _, err = reference.communicate(timeout=300)
    assert reference.returncode == 0, err[-3000:]
    proc = _start(digits, out, "subprocess")
    wait_for_iterations(out, 3, [proc])
    (child,) = _children(proc.pid)
    os.killpg(proc.pid, signal.SIGTERM)  # the trainer and its loader process
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "stopped by SIGTERM at epoch 1" in err and "Traceback" not in err
    newest = ckpt.last_checkpoint(str(out))
    assert newest is not None and "_iter_" in newest
    assert not _alive(child)
    log = (out / "stdout.log").read_text()
    assert f"loader subprocess 1 of 1 started (pid {child}," in log
    rerun = _start(digits, out, "subprocess")
    _, err = rerun.communicate(timeout=300)
    assert rerun.returncode == 0, err[-3000:]
    # Same batches, same resume point: the threads run's weights, bit for bit.
    a, b = _weights(threads_out), _weights(out)
    assert all(torch.equal(a[k], b[k]) for k in a)


def _held_by_nobody(names):
    """Those of /dev/shm's `names` that no live process maps or holds open."""
    held = shm_held()
    return {n for n in names if n not in held}


def test_a_killed_trainer_leaves_no_loader_process_and_no_shared_memory(
    digits, tmp_path
):
    shm = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    proc = _start(digits, tmp_path, "subprocess")
    wait_for_iterations(tmp_path, 2, [proc])
    (child,) = _children(proc.pid)
    proc.send_signal(signal.SIGKILL)  # the trainer alone; the child must follow
    proc.communicate(timeout=60)
    deadline = time.time() + 10
    while _alive(child) and time.time() < deadline:
        time.sleep(0.05)
    assert not _alive(child)
    # What the dead processes left is open in no process, and stays; entries that
    # other jobs made meanwhile (tests beside this one) are held, or name their
    # creator (loky's semaphores: sem.loky-<pid>-...), or go within moments (a
    # multiprocessing semaphore between its creator's exit and its resource
    # tracker's unlink: sem.mp-...).
    ours = {str(proc.pid), str(child)}
    deadline = time.time() + 5
    while True:
        after = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
        left = _held_by_nobody(after - shm)
        left = {n for n in left if not (m := re.search(r"-(\d+)-", n)) or m[1] in ours}
        if not left or time.time() > deadline:
            break
        time.sleep(0.25)
    assert not left
