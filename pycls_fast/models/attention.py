"""Attention kernels and the per-device, per-dtype choice among them.

`attend(q, k, v, kernel)` computes softmax(q k^T / sqrt(d)) v with one of:
- 'explicit': matmul, softmax, matmul (autograd keeps the attention matrix);
- 'sdpa': torch's scaled_dot_product_attention, backend chosen by torch;
- 'sdpa_<backend>': SDPA restricted to one backend (flash, math, efficient, cudnn);
- 'auto': the kernel measured fastest for the tensor's device and dtype, from
  `MEASURED_BEST` (rerun `python -m benchmarks.attention` to refresh it; the figures
  are in docs/PERFORMANCE.md).
"""

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

_BACKENDS = {
    "sdpa_flash": SDPBackend.FLASH_ATTENTION,
    "sdpa_math": SDPBackend.MATH,
    "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION,
    "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
}

KERNELS = ["explicit", "sdpa", *_BACKENDS]

# Fastest forward+backward kernel by (device type, dtype), from benchmarks/attention.py
# on ViT-sized problems (see docs/PERFORMANCE.md). Devices not listed use 'sdpa', which
# lets torch pick (on CUDA it picks flash / memory-efficient / cuDNN kernels).
# On an AMX CPU the explicit form wins in bf16 (its matmuls run on AMX tiles, while the
# CPU flash kernel's backward does not), flash wins in fp32, and SDPA's math backend in
# fp16 (the explicit form has no fast fp16 matmul there).
MEASURED_BEST = {
    ("cpu", torch.float32): "sdpa_flash",
    ("cpu", torch.bfloat16): "explicit",
    ("cpu", torch.float16): "sdpa_math",
}


def resolve_kernel(kernel: str, device_type: str, dtype: torch.dtype) -> str:
    """Returns the concrete kernel name that `kernel` ('auto' or a name) stands for."""
    if kernel == "auto":
        return MEASURED_BEST.get((device_type, dtype), "sdpa")
    return kernel


def explicit_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v; q, k, v: (batch, heads, seq, head_dim), one dtype.

    Runs in the inputs' dtype even under autocast: autocast would compute the softmax
    in fp32 and cast the (seq x seq) matrix back and forth, which costs more than the
    attention itself on CPU. The softmax kernel accumulates in fp32 internally anyway.
    """
    scale = q.shape[-1] ** -0.5
    with torch.autocast(q.device.type, enabled=False):
        attn = torch.matmul(q * scale, k.transpose(-2, -1))
        return torch.matmul(attn.softmax(dim=-1), v)


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel: str = "auto"
) -> torch.Tensor:
    """Multi-head attention; q, k, v: (batch, heads, seq, head_dim) -> same shape."""
    kernel = resolve_kernel(kernel, q.device.type, q.dtype)
    if kernel == "explicit":
        return explicit_attention(q, k, v)
    if kernel == "sdpa":
        return F.scaled_dot_product_attention(q, k, v)
    with sdpa_kernel(_BACKENDS[kernel]):
        return F.scaled_dot_product_attention(q, k, v)
