"""Shared test helpers: the repository root, tiny configs, running a tool, MKL's
kernel branch."""

import ast
import contextlib
import ctypes
import glob
import os
import re
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence

import torch

from pycls_fast.config import get_cfg, load_cfg

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

# mkl_cbwr.h's branch numbers: the kernels MKL chose for this process.
MKL_BRANCHES = {
    2: "COMPATIBLE (its path on non-Intel CPUs)",
    8: "SSE4_2",
    9: "AVX",
    10: "AVX2",
    12: "AVX512",
    14: "AVX512_E1 (Intel's path with AVX-512 VNNI/bf16)",
    15: "AVX512_E2",
    16: "AVX512_E3",
    17: "AVX512_E4",
    18: "AVX2_E1",
    19: "AVX512_E5",
}
MKL_COMPATIBLE = 2
MKL_AVX512_BRANCHES = {12, 14, 15, 16, 17, 19}


def mkl_branch() -> int | None:
    """MKL's kernel branch for this process (a key of MKL_BRANCHES), or None for a
    torch build without MKL inside. MKL chooses by vendor as well as by instruction
    set, which is where AMD and Intel machines' fp32 sums differ; `make
    test-intel-mkl` runs Intel's branch on another vendor's CPU."""
    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    try:
        return int(ctypes.CDLL(path).mkl_serv_cbwr_get_auto_branch())
    except (OSError, AttributeError):  # another build of torch: no MKL inside
        return None


def tiny_cfg(*opts: str):
    """A checked config for a tiny ViT (32 px, 8 px patches, width 48, 2 blocks)."""
    return load_cfg(None, TINY + list(opts))


def tool_command(name: str, *args: str, launcher: Sequence[str] = ()) -> list[str]:
    """`python tools/<name> args...`, or `launcher tools/<name> args...` (e.g.
    torchrun's `python -m torch.distributed.run --nproc_per_node 2`)."""
    return [*(launcher or [sys.executable]), os.path.join(ROOT, "tools", name), *args]


def one_thread_env(**extra: str) -> dict[str, str]:
    """This environment with one thread per process (OMP_NUM_THREADS=1): processes
    that share the machine's cores do not oversubscribe them."""
    return {**os.environ, "OMP_NUM_THREADS": "1", **extra}


def run_tool(
    name: str,
    *args: str,
    timeout: int = 600,
    env: Mapping[str, str] | None = None,
    launcher: Sequence[str] = (),
) -> subprocess.CompletedProcess:
    """Runs `python tools/<name> args...` from the repository root, output captured
    as text; `env`: the process's whole environment (default: this one's)."""
    return subprocess.run(
        tool_command(name, *args, launcher=launcher),
        capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env,
    )  # fmt: skip


def start_tool(
    name: str, *args: str, env: Mapping[str, str] | None = None, **popen
) -> subprocess.Popen:
    """Starts `python tools/<name> args...` from the repository root, stdout and
    stderr piped as text (`popen` overrides, e.g. stderr=subprocess.STDOUT)."""
    kw = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **popen}
    return subprocess.Popen(
        tool_command(name, *args), text=True, cwd=ROOT, env=env, **kw
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


# Where a claim is exactness (two layouts or schedules of the same sums), runs are
# compared in float64: they differ only in the order of their sums, so they agree to
# within rounding noise many orders below any real defect, on any CPU. sqrt(float64
# eps) ~ 1.5e-8: float64 summation-order noise (n * eps ~ 1e-13 for the reductions of a
# tiny model, amplified over a few steps) stays far below it, and a defect (a wrong
# shard, a missing reduction) moves weights by 1e-3 or more.
EXACT = {"rtol": torch.finfo(torch.float64).eps ** 0.5, "atol": 1e-12}
# json_stats keeps 6 significant digits: a logged figure is within half a unit of
# the 6th digit of the value, 5e-6 of it relatively.
JSON_REL = 0.5e-5


@contextlib.contextmanager
def float64_default():
    """Models, optimizers and synthetic inputs built inside are float64 (see EXACT)."""
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(torch.float32)


def chance_error_bound(classes: int, images: int, sigmas: float = 5.0) -> float:
    """A top-1 error (%) that guessing among `classes` balanced classes reaches on
    `images` test images with probability under ~3e-7 (`sigmas` binomial standard
    deviations below its mean error): an error below it means the model learned."""
    p = 1.0 / classes
    return 100.0 * ((1.0 - p) - sigmas * (p * (1.0 - p) / images) ** 0.5)


def digits_opts(digits: str, out_dir, *opts: str) -> list[str]:
    """Overrides of the digits demo config (DIGITS_CFG), shrunk for tests: 16 px
    images, 2 blocks of width 32 (MLP 64), 128 images a step (11 steps an epoch),
    200 a test batch, 1 loader thread, hard labels (the demo's label smoothing
    flattens the few steps' losses that parity tolerances are scaled by), no
    kept-best checkpoint (retention tests count the files); `opts` come last, so
    they win."""
    return [
        "DATA.PATH", digits, "OUT_DIR", str(out_dir),
        "TRAIN.IM_SIZE", "16", "TEST.IM_SIZE", "16",
        "VIT.NUM_LAYERS", "2", "VIT.HIDDEN_DIM", "32", "VIT.MLP_DIM", "64",
        "TRAIN.BATCH_SIZE", "128", "TEST.BATCH_SIZE", "200",
        "DATA_LOADER.NUM_WORKERS", "1", "TRAIN.LABEL_SMOOTHING", "0.0",
        "TRAIN.CHECKPOINT_KEEP_BEST", "False",
        *opts,
    ]  # fmt: skip


def digits_cfg(digits: str, out_dir, *opts: str):
    """The checked config of `digits_opts`."""
    return load_cfg(DIGITS_CFG, digits_opts(digits, out_dir, *opts))


def loader_cfg(root: str, tmp_path, classes: int, **over):
    """A config for the loaders alone over the image folder `root`: 32 px training
    crops, 36 px test resizes, 4 images a batch, 2 loader threads. `over` sets
    NODE__KEY=value (e.g. DATA__FORMAT="shards") last."""
    cfg = get_cfg()
    cfg.DATA.PATH = root
    cfg.OUT_DIR = str(tmp_path / "out")
    cfg.MODEL.NUM_CLASSES = classes
    cfg.TRAIN.IM_SIZE, cfg.TEST.IM_SIZE = 32, 36
    cfg.TRAIN.BATCH_SIZE, cfg.TEST.BATCH_SIZE = 4, 4
    cfg.DATA_LOADER.NUM_WORKERS = 2
    for key, value in over.items():
        node, name = key.split("__")
        cfg[node][name] = value
    return cfg


def one_epoch(loader, epoch: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every (images, labels) batch of `epoch`, copied out of the loader's buffers."""
    loader.set_epoch(epoch)
    return [(x.clone(), y.clone()) for x, y in loader]


def order_tolerance(dtype: torch.dtype, terms: int, steps: int = 1) -> float:
    """A relative tolerance for two computations of one value that differ only in
    the order of their floating-point sums (a batch split over ranks or micro-batches,
    another kernel's blocking), where comparing in float64 is not possible (a tool's
    printed figures, a low-precision mode under test). A sum of `terms` values errs
    by at most (terms - 1) * u relative to the sum of their magnitudes (u = eps / 2;
    Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., 4.2), so two
    orders differ by at most terms * eps; `steps` chained steps (training steps
    compound their errors) add their bounds. A worst case: the typical difference is
    about sqrt(terms) times smaller."""
    return terms * torch.finfo(dtype).eps * steps


def rounding_tolerance(dtype: torch.dtype, roundings: int, lam: float = 5.0) -> float:
    """A relative tolerance for one value that two computations round differently at
    `roundings` places on its path (another kernel's or layout's rounding of an
    activation or product: a relative error <= u = eps / 2 each, passed on to first
    order unamplified). As independent mean-zero errors they sum to at most
    lam * sqrt(roundings) * u with probability >= 1 - 2 exp(-lam^2 / 2) (Higham and
    Mary, SIAM J. Sci. Comput. 41(5), 2019, Thm. 2.4); lam = 5: 7e-6."""
    return lam * roundings**0.5 * torch.finfo(dtype).eps / 2


def vit_roundings(layers: int, split_sums: int = 0) -> int:
    """Roundings a bf16 ViT forward may place differently under another layout: each
    block's 6 matmul outputs (q/k/v, scores, attention x v, projection, 2 MLP) may
    round to the other neighbour (2 u, counted twice), plus the stem's and head's;
    `split_sums` per block (tensor parallelism's row-parallel outputs: each half
    rounded, then their sum) add 2 each."""
    return layers * (2 * 6 + 2 * split_sums) + 2 * 2


def amp_loss_tolerance(losses: Sequence[float], roundings: int) -> float:
    """An absolute bound on two bf16 runs' per-step losses (`losses`: one run's):
    the forward's `roundings` (rounding_tolerance) relative to the largest loss, plus
    the updates': each side rounds a weight gradient once (R = eps per step), so to
    first order the loss curves part by at most R times the distance the loss
    travels (as test_distributed's BF16_R)."""
    losses = torch.as_tensor(losses, dtype=torch.float64)
    forward = rounding_tolerance(torch.bfloat16, roundings) * losses.abs().max()
    updates = torch.finfo(torch.bfloat16).eps * (losses.max() - losses.min())
    return float(forward + updates)


def held_out_images(root: str) -> int:
    """The images of the image folder `root`'s val split."""
    return sum(len(files) for _, _, files in os.walk(os.path.join(root, "val")))


def one_image_pct(root: str) -> float:
    """One val image of the folder `root` as a top-1 error (%), plus json_stats'
    rounding (6 significant digits) of the two errors compared."""
    return 100.0 / held_out_images(root) + 2 * JSON_REL * 100.0


def sampling_band(n: int, std: float, sigmas: float = 5.0) -> float:
    """How far the mean of `n` independent draws of standard deviation `std` may
    stray from its expectation: `sigmas` standard errors (central limit; beyond 5,
    probability under 6e-7). A frequency p is the mean of draws of std
    sqrt(p (1 - p))."""
    return sigmas * std / n**0.5


@contextlib.contextmanager
def backend_flags_restored():
    """Yields the backend flags apply_backend_flags sets, as they were (matmul
    precision, oneDNN's and cuDNN's fp32 math, cuDNN benchmark), and restores them
    through the same APIs: writing the CUDA matmul's fp32_precision directly would
    leave torch's two APIs mixed, and torch.get_float32_matmul_precision() raising
    for every later test."""
    saved = (
        torch.get_float32_matmul_precision(),
        torch.backends.mkldnn.matmul.fp32_precision,
        torch.backends.cudnn.conv.fp32_precision,
        torch.backends.cudnn.benchmark,
    )
    try:
        yield saved
    finally:
        torch.set_float32_matmul_precision(saved[0])
        torch.backends.mkldnn.matmul.fp32_precision = saved[1]
        torch.backends.cudnn.conv.fp32_precision = saved[2]
        torch.backends.cudnn.benchmark = saved[3]


def wait_for_iterations(out_dir, count: int, procs=(), timeout: float = 120):
    """Waits until OUT_DIR's log shows `count` train_iter records; returns the last,
    or None as soon as one of `procs` (the run's processes) has ended."""
    from pycls_fast.observe.logging import load_json_stats

    log = os.path.join(out_dir, "stdout.log")
    deadline = time.time() + timeout
    while time.time() < deadline:
        if os.path.exists(log):
            iters = [r for r in load_json_stats(log) if r["_type"] == "train_iter"]
            if len(iters) >= count:
                return iters[-1]
        if any(p.poll() is not None for p in procs):
            return None
        time.sleep(0.1)
    raise AssertionError(f"no {count} iterations logged in {timeout} s")


def shm_held(pids: Sequence[int] | None = None) -> set[str]:
    """The /dev/shm entries that the processes `pids` (default: every process this
    one may read) map or hold open. Tests run side by side (`make test`'s two
    workers) make and drop entries of their own in /dev/shm meanwhile: a test asks
    which entries its own processes hold, not what the folder lists."""
    held = set()
    if pids is None:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                held.update(line.split("/dev/shm/", 1)[1].split(" ")[0].strip()
                            for line in f if "/dev/shm/" in line)  # fmt: skip
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:  # the process ended, or is not ours to read
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:  # closed since the listing (listdir's own fd, for one)
                continue
            if target.startswith("/dev/shm/"):
                held.add(target[len("/dev/shm/") :].split(" ")[0])
    return held
