"""benchmarks/gpu_node.sh (`make bench-gpu`), run on a CPU with a tiny config: every
phase starts, exits 0 and leaves what docs/PERFORMANCE.md's GPU section is read from."""

import json
import os
import re
import subprocess
import sys

from tests.helpers import ROOT


def test_gpu_node_script_runs_every_phase(tmp_path):
    out = tmp_path / "gpu_node"
    bin_dir = os.path.dirname(sys.executable)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "PY": sys.executable,
        "CFG": "configs/examples/vit_tiny_cpu.yaml",
        "BATCH": "16",
        "MODES": "O1",
        "SECONDS_EACH": "2",
        "COMPILE": "0",
        "IMAGES": "8",
        "EPOCHS": "1",
        "LARGE": "40",
        "ROUNDS": "1",
        "ITERS": "1",
        "CHECKS": "device,amp",
    }
    run = subprocess.run(
        ["bash", "benchmarks/gpu_node.sh", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    phases = re.findall(r"gpu_node: (\S+) exit (\d+) in", run.stdout)
    assert phases == [
        ("check_node", "0"), ("time_O1", "0"), ("ladder", "0"), ("images", "0"),
        ("train_O1", "0"),
    ]  # fmt: skip
    summary = r"O1: time_net (\d+) img/s, train_net (\d+) img/s"
    ((step, real),) = re.findall(summary, run.stdout)
    assert int(step) > 0 and int(real) > 0
    # The figures the docs' tables come from.
    record = json.loads((out / "ladder.json").read_text())
    assert [r["name"] for r in record["rows"]] == [
        "ddp", "amp", "fsdp", "mta", "pooled", "batch_second", "amp_o2", "im256", "o3",
    ]  # fmt: skip
    assert (out / "ladder" / "ladder.png").stat().st_size > 0
    assert "AMP O1 (bf16) vs fp32" in (out / "check_node.log").read_text()
    timed = json.loads((out / "time_O1.log").read_text().strip().splitlines()[-1])
    assert timed["batch_per_process"] == 16 and timed["train_img_per_s"] > 0
    assert (out / "train_O1" / "checkpoints").is_dir()


def test_gpu_node_script_fails_when_a_phase_fails(tmp_path):
    """Every phase runs even after one fails, and the script's status says so."""
    fake = tmp_path / "bin"
    fake.mkdir()
    for name, status in (("python", 1), ("torchrun", 3)):
        (fake / name).write_text(f"#!/bin/sh\nexit {status}\n")
        (fake / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "PY": "python",
           "NPROC": "1", "MODES": "O1", "COMPILE": "0"}  # fmt: skip
    run = subprocess.run(
        ["bash", "benchmarks/gpu_node.sh", str(tmp_path / "o")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 1
    assert re.findall(r"gpu_node: (\S+) exit (\d+) in", run.stdout) == [
        ("check_node", "1"), ("time_O1", "1"), ("ladder", "3"), ("images", "1"),
        ("train_O1", "3"),
    ]  # fmt: skip


def test_gpu_node_script_refuses_a_missing_config_in_one_line(tmp_path):
    env = {**os.environ, "CFG": "configs/missing.yaml"}
    run = subprocess.run(
        ["bash", "benchmarks/gpu_node.sh", str(tmp_path / "o")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 2
    assert run.stderr == "gpu_node: no config file configs/missing.yaml\n"
