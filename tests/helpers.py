"""Shared test helpers: the repository root, tiny configs, running a tool."""

import os
import subprocess
import sys

from pycls_fast.config import load_cfg

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIGITS_CFG = os.path.join(ROOT, "configs/examples/vit_digits.yaml")

TINY = [
    "TRAIN.IM_SIZE", "32",
    "TEST.IM_SIZE", "32",
    "VIT.PATCH_SIZE", "8",
    "VIT.HIDDEN_DIM", "48",
    "VIT.NUM_HEADS", "4",
    "VIT.MLP_DIM", "96",
    "VIT.NUM_LAYERS", "2",
    "MODEL.NUM_CLASSES", "10",
    "LN.EPS", "1e-6",
]  # fmt: skip


def tiny_cfg(*opts: str):
    """A checked config for a tiny ViT (32 px, 8 px patches, width 48, 2 blocks)."""
    return load_cfg(None, TINY + list(opts))


def run_tool(name: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """Runs `python tools/<name> args...` from the repository root, output captured."""
    cmd = [sys.executable, os.path.join(ROOT, "tools", name), *args]
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


def run_benchmark(name: str, *args: str, timeout: int = 300):
    """Runs `python -m benchmarks.<name> args...` from the repository root, as make
    does."""
    cmd = [sys.executable, "-m", f"benchmarks.{name}", *args]
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )
