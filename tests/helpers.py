"""Shared test helpers: the repository root, tiny configs, running a tool."""

import ast
import glob
import os
import re
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


def vit_param_count(cfg) -> int:
    """A ViT's parameters from its dimensions by the published architecture
    (Dosovitskiy et al. 2020; conv stem: Xiao et al. 2021; DeiT's distillation
    token; CaiT's layer scale), written apart from models/vit.py to check it."""
    v, w, m = cfg.VIT, cfg.VIT.HIDDEN_DIM, cfg.VIT.MLP_DIM
    if v.STEM_TYPE == "patchify":
        stem, grid, c_in = 3 * v.PATCH_SIZE**2 * w + w, v.PATCH_SIZE, 3
    else:  # 3x3 conv + BN (weight, bias) layers, then a conv with a bias
        stem, grid, c_in = 0, 1, 3
        layers = list(zip(v.C_STEM_KERNELS, v.C_STEM_DIMS, v.C_STEM_STRIDES))
        for i, (k, c_out, s) in enumerate(layers):
            last = i == len(layers) - 1
            stem += (k if last else 3) ** 2 * c_in * c_out + (
                c_out if last else 2 * c_out
            )
            c_in, grid = c_out, grid * s
    tokens = (v.CLASSIFIER_TYPE == "token") + bool(v.DISTILL_TOKEN)
    positions = (cfg.TRAIN.IM_SIZE // grid) ** 2 + tokens
    block = (
        2 * 2 * w  # two LayerNorms
        + 3 * w * w + 3 * w  # packed q/k/v with biases
        + w * w + w  # attention output projection
        + w * m + m + m * w + w  # MLP
        + (2 * w if v.LAYER_SCALE else 0)  # a gamma per residual branch
        + (2 * 2 * (w // v.NUM_HEADS) if v.QK_NORM else 0)  # q and k LayerNorms
    )  # fmt: skip
    heads = 1 + bool(v.DISTILL_TOKEN)
    classes = cfg.MODEL.NUM_CLASSES
    return (
        stem + tokens * w + positions * w + v.NUM_LAYERS * block + 2 * w
        + heads * (w * classes + classes)
    )  # fmt: skip


def documented_options(path: str) -> set[str]:
    """The `--options` a tool or benchmark (its path from the root, e.g.
    "tools/info_net.py") documents: in its own docstring and in every command of
    README.md, docs/*.md or the Makefile that runs it (continued lines joined)."""
    if path.startswith("tools/"):
        name = re.escape(path)
    else:  # benchmarks/ladder.py runs as `python -m benchmarks.ladder`
        name = re.escape(path[: -len(".py")].replace("/", "."))
    with open(os.path.join(ROOT, path)) as f:
        text = ast.get_docstring(ast.parse(f.read())) or ""
    # Not the options of another tool the docstring shows (`tools/train_net.py --cfg`).
    text = re.sub(rf"(tools/\w+\.py|benchmarks\.\w+(?!\w))(?<!{name})[^`\n]*", "", text)
    docs = glob.glob(os.path.join(ROOT, "docs", "*.md"))
    for doc in [os.path.join(ROOT, "README.md"), os.path.join(ROOT, "Makefile"), *docs]:
        with open(doc) as f:
            joined = re.sub(r"\\\n", " ", f.read())
        for line in joined.splitlines():
            for m in re.finditer(rf"{name}(?![\w.])([^|;&#`]*)", line):
                text += " " + m[1]
    return set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", text))


def assert_help_lists(path: str, result: subprocess.CompletedProcess) -> None:
    """`--help` exited 0 and names every option that `path` documents."""
    assert result.returncode == 0, result.stderr
    documented = documented_options(path)
    assert documented, f"{path} documents no option: nothing to check"
    shown = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", result.stdout))
    assert sorted(documented - shown) == [], f"{path}: documented, not in --help"
