"""Achieved TFLOP/s per device and MFU, from the model's own complexity.

    peak = device_peak_flops(device, dtype, stated_tflops=cfg.MFU.PEAK_TFLOPS)
    model = Throughput(flops_per_image, world_size, peak, recompute=True)
    model.fields(img_per_s)   # {tflops, hw_tflops, mfu, hfu}

Model FLOPs of a training image: the forward's multiply-adds (models.complexity,
pycls's convention) x 2 FLOPs x 3 (forward, and a backward of two forwards), the
usual MFU convention (PaLM, torchtitan). Activation recomputation
(FSDP.ACTIVATION_CHECKPOINT) runs the forward a second time: those FLOPs are
hardware FLOPs (`hw_tflops`, `hfu`), not model FLOPs, so MFU does not rise when
recomputation is turned on.

The peak is the device's dense (no 2:4 sparsity) tensor-core peak for the dtype the
matmuls run in, from PEAK_TFLOPS below (NVIDIA's datasheets, the "dense" column; the
datasheets print sparse figures, twice these). An unknown GPU has no peak (mfu 0)
unless MFU.PEAK_TFLOPS states one. On a CPU the peak is a large matmul measured
once and cached per CPU model, thread count and dtype in the user's cache folder
(MFU.PEAK_TFLOPS states it instead).
"""

import json
import os
import platform
import time

import torch

# Dense peak TFLOP/s by GPU (a substring of torch.cuda.get_device_name, first match
# wins: longer names first) and matmul dtype. Sources: NVIDIA H100 datasheet (SXM,
# PCIe, NVL columns), H200 datasheet (SXM), A100 datasheet, L40S, L4 and A10
# datasheets, V100 datasheet (SXM2); each tensor-core figure there is "with
# sparsity", halved here. fp32 is the non-tensor-core figure; tf32 applies when
# torch.backends.cuda.matmul.allow_tf32 is on.
PEAK_TFLOPS: list[tuple[str, dict[str, float]]] = [
    ("H100 PCIe", {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.0}),
    ("H100 NVL", {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0}),
    ("H100", {"bf16": 989.5, "fp16": 989.5, "tf32": 494.5, "fp32": 67.0}),
    ("H200", {"bf16": 989.5, "fp16": 989.5, "tf32": 494.5, "fp32": 67.0}),
    ("A100", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    ("L40S", {"bf16": 366.5, "fp16": 366.5, "tf32": 183.0, "fp32": 91.6}),
    ("L4", {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    ("A10", {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2}),
    ("V100", {"fp16": 125.0, "fp32": 15.7}),
]

_CACHE_FILE = "matmul_peak.json"


def dtype_name(dtype: torch.dtype, device: torch.device) -> str:
    """'bf16', 'fp16', 'tf32' (fp32 matmuls on a GPU that allows TF32) or 'fp32'."""
    if dtype == torch.bfloat16:
        return "bf16"
    if dtype == torch.float16:
        return "fp16"
    if device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "fp32"


def table_peak_tflops(device_name: str, dtype: str) -> float | None:
    """The dense peak TFLOP/s of the GPU named `device_name` for `dtype`, or None
    when the table does not know that GPU or that dtype on it."""
    for pattern, peaks in PEAK_TFLOPS:
        if pattern.lower() in device_name.lower():
            return peaks.get(dtype)
    return None


def cache_dir() -> str:
    """The user's cache folder of pycls_fast ($XDG_CACHE_HOME or ~/.cache)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return os.path.join(base, "pycls_fast")


def measure_matmul_flops(dtype: torch.dtype, size: int = 1024, iters: int = 3) -> float:
    """FLOP/s of a square `size` matmul in `dtype` on the CPU (best of `iters`,
    after one warm-up call): the CPU's practical matmul peak."""
    # A generator of its own: the run's seeded streams stay untouched.
    g = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=g).to(dtype)
    b = torch.randn(size, size, generator=g).to(dtype)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(iters):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2.0 * size**3 / max(best, 1e-9)


def cpu_peak_flops(dtype: torch.dtype, folder: str | None = None) -> float:
    """The CPU's matmul peak in `dtype`, measured the first time and then read from
    `folder`/matmul_peak.json (default: cache_dir()), keyed by CPU model, thread
    count and dtype."""
    folder = folder or cache_dir()
    path = os.path.join(folder, _CACHE_FILE)
    cpu = platform.processor() or platform.machine()
    key = f"{cpu}|{torch.get_num_threads()}|{dtype}"
    cached = {}
    try:
        with open(path) as f:
            cached = json.load(f)
    except (OSError, ValueError):
        pass
    if key in cached:
        return float(cached[key])
    flops = measure_matmul_flops(dtype)
    cached[key] = flops
    try:
        os.makedirs(folder, exist_ok=True)
        tmp = f"{path}.tmp.{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(cached, f, indent=1)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home: measured again next time
    return flops


def device_peak_flops(
    device: torch.device,
    dtype: torch.dtype,
    stated_tflops: float = 0.0,
    folder: str | None = None,
) -> tuple[float | None, str]:
    """(peak FLOP/s of one device for matmuls in `dtype`, where it comes from).
    `stated_tflops` > 0 (MFU.PEAK_TFLOPS) wins; a GPU is looked up in PEAK_TFLOPS;
    a CPU is measured once (cached in `folder`). None when nothing is known."""
    if stated_tflops > 0:
        return stated_tflops * 1e12, "MFU.PEAK_TFLOPS"
    name = dtype_name(dtype, device)
    if device.type == "cuda":
        gpu = torch.cuda.get_device_name(device)
        peak = table_peak_tflops(gpu, name)
        if peak is None:
            return None, f"{gpu} {name}: not in the peak table (set MFU.PEAK_TFLOPS)"
        return peak * 1e12, f"{gpu} {name} dense peak (datasheet)"
    if device.type == "cpu":
        return cpu_peak_flops(dtype, folder), f"CPU {name} matmul, measured"
    return None, f"{device.type}: no known peak (set MFU.PEAK_TFLOPS)"


class Throughput:
    """TFLOP/s per device and MFU of a training run, from images per second."""

    def __init__(
        self,
        flops_per_image: float,
        world_size: int,
        peak_flops: float | None,
        recompute: bool = False,
    ) -> None:
        """`flops_per_image`: the forward's multiply-adds of one image (pycls's
        `flops`); `world_size`: the devices sharing the work; `peak_flops`: one
        device's peak FLOP/s (None: unknown, MFU 0); `recompute`: activation
        checkpointing reruns the forward in backward."""
        forward = 2.0 * flops_per_image
        self.model_flops = 3.0 * forward
        self.hw_flops = self.model_flops + (forward if recompute else 0.0)
        self.world_size = max(world_size, 1)
        self.peak = peak_flops

    def fields(self, img_per_s: float) -> dict[str, float]:
        """{tflops, hw_tflops, mfu, hfu} of one device at `img_per_s` images per
        second over all devices (mfu, hfu: fractions of the peak)."""
        per_device = img_per_s / self.world_size
        model, hardware = self.model_flops * per_device, self.hw_flops * per_device
        peak = self.peak or 0.0
        return {
            "tflops": model / 1e12,
            "hw_tflops": hardware / 1e12,
            "mfu": model / peak if peak else 0.0,
            "hfu": hardware / peak if peak else 0.0,
        }
