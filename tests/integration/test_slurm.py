"""LAUNCH.MODE submitit_local and slurm, end to end: a 2-rank job trains as a local
2-process run does, bit for bit; a job stopped by the time-limit signal (USR2) or
preempted (`scontrol requeue`) resumes and ends identical; a failing job reports its
reason; a job of two nodes (two slurmd daemons on this host) preempted and resumed
ends identical too. The SLURM tests start a real two-node cluster on this host
(tests/slurm/cluster.sh) when SLURM is installed (`make test` installs it as root),
else they skip.
"""

import os
import re
import shutil
import signal
import subprocess
import time

import psutil
import pytest
import torch

from pycls_fast.checkpoint import files
from tests.helpers import DIGITS_CFG, ROOT, digits_opts, run_tool, start_tool

pytestmark = pytest.mark.slow  # a SLURM cluster on this host, jobs of 2 ranks

CLUSTER = os.path.join(ROOT, "tests", "slurm", "cluster.sh")


def _opts(digits, out_dir, *more):
    return digits_opts(
        digits, out_dir, "NUM_GPUS", "2", "VIT.NUM_LAYERS", "1",
        "TRAIN.BATCH_SIZE", "64", "OPTIM.MAX_EPOCH", "4", "OPTIM.WARMUP_EPOCHS", "1",
        "LOG_PERIOD", "2", "TRAIN.PREEMPT_CHECK_PERIOD", "1",
        "LAUNCH.CPU_ONLY", "True", "LAUNCH.CPUS_PER_GPU", "1",
        "LAUNCH.MEM_PER_GPU", "1", "LAUNCH.PARTITION", "debug",
        "LAUNCH.TIME_LIMIT", "30", *more,
    )  # fmt: skip


def _train(*opts, wait=True):
    if not wait:
        return start_tool("train_net.py", "--cfg", DIGITS_CFG, *opts)
    return run_tool("train_net.py", "--cfg", DIGITS_CFG, *opts)


def _weights(out_dir):
    state = files.load_checkpoint(files.last_checkpoint(str(out_dir)))
    return state["epoch"], state["model_state"]


def _assert_same_weights(out_dir, reference):
    epoch, weights = _weights(out_dir)
    ref_epoch, ref_weights = reference
    assert epoch == ref_epoch
    assert weights.keys() == ref_weights.keys()
    assert all(torch.equal(weights[k], ref_weights[k]) for k in weights)


@pytest.fixture(scope="module")
def reference(digits, tmp_path_factory):
    """The final weights of the same training as a local 2-process run."""
    out = tmp_path_factory.mktemp("local")
    result = _train(*_opts(digits, out))
    assert result.returncode == 0, result.stderr
    return _weights(out)


def _log(out_dir):
    path = os.path.join(out_dir, "stdout.log")
    if not os.path.exists(path):
        return ""
    with open(path) as f:
        return f.read()


def _wait_for(condition, timeout, what):
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def _in_epoch(out_dir, epoch):
    return lambda: f'"epoch": "{epoch}/4", "eta"' in _log(out_dir)


def _job_id(proc):
    first = proc.stdout.readline()
    match = re.match(r"submitted job (\d+)", first)
    assert match, first
    return match.group(1)


def _finish(proc):
    out, err = proc.communicate(timeout=600)
    return proc.returncode, out, err


def test_a_submitit_local_job_trains_as_a_local_run(digits, tmp_path, reference):
    result = _train(
        *_opts(digits, tmp_path, "LAUNCH.MODE", "submitit_local", "LAUNCH.WAIT", "True")
    )
    assert result.returncode == 0, result.stderr
    assert "submitted job" in result.stdout and "final top-1 accuracy" in result.stdout
    _assert_same_weights(tmp_path, reference)


def _task_pids():
    """The submitit task processes of this machine (each runs one rank)."""
    return [
        p.pid
        for p in psutil.process_iter(["cmdline"])
        if "submitit.core._submit" in " ".join(p.info["cmdline"] or [])
    ]


def test_a_submitit_local_job_stopped_by_usr2_is_requeued_and_ends_identical(
    digits, tmp_path, reference
):
    opts = _opts(
        digits, tmp_path, "LAUNCH.MODE", "submitit_local", "LAUNCH.WAIT", "True"
    )
    proc = _train(*opts, wait=False)
    _job_id(proc)
    _wait_for(_in_epoch(tmp_path, 2), 120, "epoch 2")
    for pid in _task_pids():
        os.kill(pid, signal.SIGUSR2)  # what SLURM sends before the time limit
    code, out, err = _finish(proc)
    assert code == 0, err
    log = _log(tmp_path)
    assert "stopped by SIGUSR2" in log and "resumed from" in log
    _assert_same_weights(tmp_path, reference)


# ------------------------------- a real SLURM cluster ------------------------------- #


def _cluster_answers():
    try:
        out = subprocess.run(
            ["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "idle" in out.stdout or "mix" in out.stdout or "alloc" in out.stdout


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A running cluster: this machine's, or the two-node one started here (and
    stopped after the tests)."""
    missing = [p for p in ("sbatch", "slurmctld", "slurmd", "munged")
               if shutil.which(p) is None]  # fmt: skip
    if missing:
        pytest.skip(
            f"SLURM is not installed ({', '.join(missing)} missing): `make test` "
            "installs it as root with apt-get (tests/slurm/cluster.sh install)"
        )
    if _cluster_answers():
        yield
        return
    state = str(tmp_path_factory.mktemp("slurm"))
    env = {**os.environ, "STATE": state}
    up = subprocess.run(["bash", CLUSTER, "up"], capture_output=True, text=True,
                        env=env, timeout=120)  # fmt: skip
    if up.returncode:
        subprocess.run(["bash", CLUSTER, "down"], env=env, timeout=120)
        pytest.skip(
            f"could not start a SLURM cluster: {(up.stdout + up.stderr)[-500:]}"
        )
    yield
    subprocess.run(["bash", CLUSTER, "down"], env=env, timeout=120)


def _state(job_id):
    out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"],
                         capture_output=True, text=True)  # fmt: skip
    return out.stdout.strip()


def _start_now(job_id):
    """A requeued job waits (AuthInfo cred_expire) before it may start: start it."""
    _wait_for(lambda: _state(job_id) != "RUNNING", 60, "the job to leave RUNNING")
    end = time.monotonic() + 90
    while _state(job_id) not in ("RUNNING", "") and time.monotonic() < end:
        subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"],
                       capture_output=True)  # fmt: skip
        time.sleep(1)


def _slurm_opts(digits, out_dir, *more):
    return _opts(digits, out_dir, "LAUNCH.MODE", "slurm", "LAUNCH.WAIT", "True", *more)


def test_a_slurm_job_trains_as_a_local_run(slurm, digits, tmp_path, reference):
    result = _train(*_slurm_opts(digits, tmp_path, "LAUNCH.SIGNAL_DELAY_S", "45"))
    assert result.returncode == 0, result.stderr
    job_id = re.search(r"submitted job (\d+) to SLURM", result.stdout).group(1)
    assert f"squeue -j {job_id}" in result.stdout
    _assert_same_weights(tmp_path, reference)
    # The time-limit signal is asked for in the batch script.
    script = (tmp_path / "submitit" / f"{job_id}_submission.sh").read_text()
    assert (
        "#SBATCH --signal=USR2@45" in script and "#SBATCH --ntasks-per-node=2" in script
    )


@pytest.mark.parametrize("how", ["time_limit_signal", "scontrol_requeue"])
def test_a_stopped_slurm_job_resumes_and_ends_identical(
    slurm, digits, tmp_path, reference, how
):
    proc = _train(*_slurm_opts(digits, tmp_path), wait=False)
    job_id = _job_id(proc)
    _wait_for(_in_epoch(tmp_path, 2), 180, "epoch 2")
    if how == "time_limit_signal":
        # What SLURM sends LAUNCH.SIGNAL_DELAY_S before the time limit (to the steps).
        subprocess.run(["scancel", "--signal=USR2", job_id], check=True)
    else:
        subprocess.run(["scontrol", "requeue", job_id], check=True)  # preemption
    _start_now(job_id)
    code, out, err = _finish(proc)
    assert code == 0, err
    log = _log(tmp_path)
    signame = "SIGUSR2" if how == "time_limit_signal" else "SIGTERM"
    assert f"stopped by {signame}" in log and "resumed from" in log
    _assert_same_weights(tmp_path, reference)


def _nodes():
    """The cluster's node names (whatever their state)."""
    out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], capture_output=True,
                         text=True, timeout=10)  # fmt: skip
    return sorted(set(out.stdout.split()))


def test_a_two_node_slurm_job_preempted_resumes_and_ends_identical(
    slurm, digits, tmp_path, reference
):
    """MAX_GPUS_PER_NODE 1: the 2 ranks are a job of 2 nodes x 1 task (two slurmd
    daemons on this host, tests/slurm/cluster.sh). The ranks meet at the first
    node's name, each node's rank is LOCAL_RANK 0; preempted (`scontrol requeue`)
    in epoch 2, the job starts again on both nodes, resumes and ends as the local
    2-process run does, bit for bit."""
    if len(_nodes()) < 2:
        pytest.skip(f"the running SLURM cluster has one node ({_nodes()})")
    opts = _slurm_opts(digits, tmp_path, "MAX_GPUS_PER_NODE", "1")
    proc = _train(*opts, wait=False)
    job_id = _job_id(proc)
    _wait_for(_in_epoch(tmp_path, 2), 180, "epoch 2")
    shown = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True,
                           text=True).stdout  # fmt: skip
    assert re.search(r"NumNodes=2 ", shown) and "NodeList=pycls-n[1-2]" in shown, shown
    subprocess.run(["scontrol", "requeue", job_id], check=True)
    _start_now(job_id)
    code, out, err = _finish(proc)
    assert code == 0, err
    log = _log(tmp_path)
    assert "stopped by SIGTERM" in log and "resumed from" in log
    script = (tmp_path / "submitit" / f"{job_id}_submission.sh").read_text()
    assert "#SBATCH --nodes=2" in script and "#SBATCH --ntasks-per-node=1" in script
    _assert_same_weights(tmp_path, reference)


def test_a_failing_slurm_job_reports_its_reason(slurm, digits, tmp_path):
    result = _train(
        *_slurm_opts(
            digits, tmp_path, "OPTIM.BASE_LR", "1e30", "OPTIM.WARMUP_EPOCHS", "0"
        )  # fmt: skip
    )
    assert result.returncode == 2
    line = result.stderr.strip().splitlines()[-1]
    assert re.match(r"error: job \d+ failed: .*loss is nan", line), line
    assert line.endswith("_log.err")


def test_a_sweep_of_four_forks_runs_through_slurm(slurm, digits, tmp_path):
    import yaml

    from tests.helpers import run_tool
    from tests.integration.test_sweep import LR_DEPTH, _write_sweep

    path = tmp_path / "sweep.yaml"
    _write_sweep(tmp_path, digits, SAMPLERS=LR_DEPTH)
    raw = yaml.safe_load(path.read_text())
    raw["LAUNCH"].update(
        MODE="slurm", PARALLEL_JOBS=2, PARTITION="debug", CPU_ONLY=True,
        CPUS_PER_GPU=1, MEM_PER_GPU=1, TIME_LIMIT=30,
    )  # fmt: skip
    path.write_text(yaml.safe_dump(raw))
    for tool in ("sweep_setup.py", "sweep_launch.py", "sweep_collect.py",
                 "sweep_analyze.py"):  # fmt: skip
        result = run_tool(tool, "--sweep-cfg", str(path))
        assert result.returncode == 0, (tool, result.stdout, result.stderr)
    sweep = os.path.join(raw["ROOT_DIR"], "tiny")
    for name in ("000000", "000001", "000002", "000003"):
        log = (tmp_path / "sweeps" / "tiny" / "logs" / name / "launch.log").read_text()
        assert re.search(r"submitted job \d+ to SLURM", log), log
        assert "final top-1 accuracy" in log
    index = os.path.join(sweep, "analysis", "index.html")
    assert os.path.getsize(index) > 1000


def test_a_dry_run_prints_the_job_and_submits_nothing(digits, tmp_path):
    # No cluster needed: the job's shape, each task's command, the logs, the script.
    out = tmp_path / "dry"
    extra = ["LAUNCH.SBATCH_ARGS", "['qos=high', 'exclusive']"]
    dry = ["LAUNCH.MODE", "slurm", "LAUNCH.DRY_RUN", "True", *extra]
    result = _train(*_opts(digits, out, *dry))
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert "dry run (LAUNCH.DRY_RUN): nothing submitted to SLURM" in text
    assert "1 node(s) x 2 task(s) x 0 GPU(s) per task = 2 rank(s), 30 min" in text
    assert f"-m submitit.core._submit {out / 'submitit'}" in text
    assert f"run log:  {out / 'stdout.log'}" in text
    for flag in ("qos=high", "exclusive", "partition=debug", "ntasks-per-node=2",
                 "signal=USR2@120"):  # fmt: skip
        assert f"#SBATCH --{flag}" in text.splitlines(), flag
    assert not out.exists()  # nothing written, nothing submitted


def test_the_neutral_defaults_make_a_job_the_cluster_accepts(slurm, digits, tmp_path):
    # pycls's defaults (partition devlab, --constraint volta) are refused by any
    # other cluster; the neutral ones take the cluster's partition and memory.
    opts = _opts(digits, tmp_path, "LAUNCH.MODE", "slurm", "LAUNCH.DRY_RUN", "True")
    i = opts.index("LAUNCH.PARTITION")
    del opts[i : i + 2]
    result = _train(*opts)
    assert result.returncode == 0, result.stderr
    script = result.stdout.split("  sbatch script:\n", 1)[1]
    assert "--partition" not in script and "--constraint" not in script
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    check = subprocess.run(["sbatch", "--test-only", str(path)], capture_output=True,
                           text=True, timeout=60)  # fmt: skip
    assert check.returncode == 0, check.stderr
    assert "to start at" in check.stderr
