"""benchmarks/gpu_node.sh (`make bench-gpu`), run on a CPU with a tiny config: every
phase starts, exits 0 and leaves what docs/PERFORMANCE.md's GPU section is read from."""

import json
import os
import re
import subprocess
import sys

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.slow  # make bench-gpu's script, every phase


def test_gpu_node_script_runs_every_phase(tmp_path):
    out = tmp_path / "gpu_node"
    bin_dir = os.path.dirname(sys.executable)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "PY": sys.executable,
        "CFG": "configs/examples/vit_tiny_cpu.yaml",
        "BATCH": "4",
        "STEPS": "2",
        "WARMUP": "1",
        "IMAGES": "4",
        "REAL_MODES": "threads subprocess",
        "PYCLS_MODES": "",  # the same code as real_O3's cells
        "O1_MODES": "subprocess",
        "RECIPES": "crop-flip",
        "EXTRA_CELLS": "deit+device:subprocess",
        "AUG_IMAGES": "8",
        "AUG_SIZE": "32",
        "GRAPHS": "0",
        "CHECKS": "device,amp",
        "LOADER": "0",  # tests/integration/test_tools.py runs benchmarks/loader.py
    }
    run = subprocess.run(
        ["bash", "benchmarks/gpu_node.sh", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=500,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    phases = re.findall(r"gpu_node: (\S+) exit (\d+) in", run.stdout)
    # fp8 needs a GPU with float8 matmuls: not this CPU.
    assert phases == [
        ("check_node", "0"), ("images", "0"), ("real_O3", "0"), ("augment", "0"),
        ("real_O1", "0"),
    ]  # fmt: skip
    # The figures the docs' tables come from.
    o3 = json.loads((out / "real_O3" / "real_run.json").read_text())
    assert [(r["recipe"], r["mode"]) for r in o3["rows"]] == [
        ("crop-flip", "threads"), ("crop-flip", "subprocess"),
        ("deit+device", "subprocess"),
    ]  # fmt: skip
    augment = json.loads((out / "augment_cost.json").read_text())
    assert {r["recipe"] for r in augment["device_policies"]} >= {"DeiT RandAugment"}
    assert (out / "real_O3" / "profile" / "trace.json").stat().st_size > 0
    o1 = json.loads((out / "real_O1" / "real_run.json").read_text())
    assert [(r["amp"], r["mode"]) for r in o1["rows"]] == [("O1", "subprocess")]
    assert "| O3 | crop-flip | subprocess |" in run.stdout
    assert "AMP O1 (bf16) vs fp32" in (out / "check_node.log").read_text()


def test_gpu_node_script_skips_what_the_budget_cannot_hold(tmp_path):
    env = {**os.environ, "PY": sys.executable, "NPROC": "1", "BUDGET_S": "0",
           "CFG": "configs/examples/vit_tiny_cpu.yaml"}  # fmt: skip
    run = subprocess.run(
        ["bash", "benchmarks/gpu_node.sh", str(tmp_path / "o")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 0
    skipped = re.findall(r"gpu_node: (\S+) skipped: ~(\d+) s", run.stdout)
    assert [name for name, _ in skipped] == [
        "check_node", "images", "real_O3", "real_pycls", "augment", "real_O1",
        "loader",
    ]  # fmt: skip


def test_gpu_node_script_fails_when_a_phase_fails(tmp_path):
    """Every phase runs even after one fails, and the script's status says so."""
    fake = tmp_path / "bin"
    fake.mkdir()
    for name, status in (("python", 1), ("torchrun", 3)):
        (fake / name).write_text(f"#!/bin/sh\nexit {status}\n")
        (fake / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "PY": "python",
           "NPROC": "1", "MODES": "O1", "COMPILE": "0", "FULL": "1"}  # fmt: skip
    run = subprocess.run(
        ["bash", "benchmarks/gpu_node.sh", str(tmp_path / "o")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 1
    assert re.findall(r"gpu_node: (\S+) exit (\d+) in", run.stdout) == [
        ("check_node", "1"), ("images", "1"), ("real_O3", "1"), ("real_pycls", "1"),
        ("augment", "1"), ("real_O1", "1"), ("loader", "1"), ("time_O1", "1"),
        ("ladder", "3"), ("train_O1", "3"),
    ]  # fmt: skip


def test_gpu_node_script_refuses_a_missing_config_in_one_line(tmp_path):
    env = {**os.environ, "CFG": "configs/missing.yaml"}
    run = subprocess.run(
        ["bash", "benchmarks/gpu_node.sh", str(tmp_path / "o")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 2
    assert run.stderr == "gpu_node: no config file configs/missing.yaml\n"
