"""Two "nodes" on one machine: two torchrun launchers (`--nnodes 2 --nproc_per_node
1`, c10d rendezvous on 127.0.0.1), each with its own node-local temporary folder
(TMPDIR), writing one shared OUT_DIR; FSDP and PP; the job is stopped from one node
(SIGTERM to its launcher, as a cluster's preemption does), checkpoints, and resumes
at another layout (one process)."""

import os
import signal
import socket
import subprocess
import sys

import pytest

from tests.helpers import DIGITS_CFG, ROOT, wait_for_iterations

pytestmark = pytest.mark.slow

TRAIN_NET = os.path.join(ROOT, "tools/train_net.py")


def _opts(digits, out_dir, *extra):
    """The demo config at 16 px and 2 blocks: 11 iterations an epoch, fp32."""
    return [
        "DATA.PATH", digits, "OUT_DIR", str(out_dir),
        "TRAIN.IM_SIZE", "16", "TEST.IM_SIZE", "16",
        "VIT.NUM_LAYERS", "2", "VIT.HIDDEN_DIM", "32", "VIT.MLP_DIM", "64",
        "TRAIN.BATCH_SIZE", "128", "TEST.BATCH_SIZE", "200",
        "OPTIM.MAX_EPOCH", "4", "OPTIM.WARMUP_EPOCHS", "0", "OPTIM.BASE_LR", "0.005",
        "LOG_PERIOD", "1", "DATA_LOADER.NUM_WORKERS", "1",
        "TRAIN.MIXED_PRECISION", "False", "AMP.MODE", "fp32",
        # torchrun gives a stopped worker 30 s before SIGKILL: check every step.
        "TRAIN.PREEMPT_CHECK_PERIOD", "1",
        *extra,
    ]  # fmt: skip


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch_two_nodes(digits, out_dir, tmp_path, extra):
    port = _free_port()
    procs = []
    for node in (0, 1):
        local = tmp_path / f"node{node}"
        local.mkdir()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(local)}
        cmd = [
            sys.executable, "-m", "torch.distributed.run",
            "--nnodes", "2", "--nproc_per_node", "1", "--node_rank", str(node),
            "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}",
            "--rdzv_id", "two-nodes", "--max_restarts", "0",
            TRAIN_NET, "--cfg", DIGITS_CFG, *_opts(digits, out_dir, *extra),
        ]  # fmt: skip
        with open(local / "launcher.log", "w") as log:  # the child keeps its copy
            procs.append(
                subprocess.Popen(
                    cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )  # fmt: skip
    return procs


# NUM_GPUS left at 1 under torchrun: the launcher's world size replaces it.
@pytest.mark.parametrize(
    "layout", [["FSDP.ENABLED", "True"], ["PARALLEL.PP", "2"]], ids=["fsdp", "pp"]
)
def test_two_nodes_stop_checkpoint_and_resume_as_one_process(digits, tmp_path, layout):
    out_dir = tmp_path / "out"  # shared by both nodes
    procs = _launch_two_nodes(digits, out_dir, tmp_path, layout)
    try:
        wait_for_iterations(out_dir, 3, procs, timeout=240)
        # Node 1's launcher is told to stop: it forwards SIGTERM to its rank, and
        # the ranks agree to stop at the next iteration, after a checkpoint.
        os.kill(procs[1].pid, signal.SIGTERM)
        codes = [p.wait(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    logs = [(tmp_path / f"node{n}" / "launcher.log").read_text() for n in (0, 1)]
    assert codes[0] == 0 or "stopped" in logs[0], logs[0][-3000:]
    ckpts = sorted(os.listdir(out_dir / "checkpoints"))
    assert ckpts and not any(c.endswith(".tmp") for c in ckpts), ckpts
    # Both ranks wrote their shards into the shared folder.
    last = out_dir / "checkpoints" / ckpts[-1]
    shards = sorted(f for f in os.listdir(last) if f.endswith(".distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"], shards
    # Each launcher kept its files in its own node's temporary folder.
    for node in (0, 1):
        assert any(
            f.startswith("torchelastic_") for f in os.listdir(tmp_path / f"node{node}")
        )
    # One process resumes the two-node checkpoint (another layout) and finishes.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    one = ["PARALLEL.PP", "1"] if "PARALLEL.PP" in layout else layout
    resumed = subprocess.run(
        [sys.executable, TRAIN_NET, "--cfg", DIGITS_CFG,
         *_opts(digits, out_dir, *one)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    text = (out_dir / "stdout.log").read_text()
    assert "resumed from" in text
