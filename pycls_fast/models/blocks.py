"""Layer helpers and their complexity counters (pycls conventions).

A complexity context `cx` is a dict {h, w, flops, params, acts}: flops counts
multiply-adds, acts counts the output elements of each layer. Every `*_cx` function
takes a context and returns the updated one, so a module's `complexity` reads like its
`forward`.
"""

import torch
from torch import nn


def conv2d(
    w_in: int, w_out: int, k: int, *, stride: int = 1, bias: bool = False
) -> nn.Conv2d:
    """A k x k conv with 'same' padding (odd k only)."""
    return nn.Conv2d(w_in, w_out, k, stride=stride, padding=(k - 1) // 2, bias=bias)


def conv2d_cx(
    cx: dict[str, int],
    w_in: int,
    w_out: int,
    k: int,
    *,
    stride: int = 1,
    bias: bool = False,
) -> dict[str, int]:
    """Complexity of `conv2d`."""
    h, w = (cx["h"] - 1) // stride + 1, (cx["w"] - 1) // stride + 1
    flops = cx["flops"] + k * k * w_in * w_out * h * w + (w_out * h * w if bias else 0)
    params = cx["params"] + k * k * w_in * w_out + (w_out if bias else 0)
    acts = cx["acts"] + w_out * h * w
    return {"h": h, "w": w, "flops": flops, "params": params, "acts": acts}


def patchify2d(w_in: int, w_out: int, k: int, *, bias: bool = True) -> nn.Conv2d:
    """A k x k conv with stride k: cuts the image into patches and embeds them."""
    return nn.Conv2d(w_in, w_out, k, stride=k, padding=0, bias=bias)


def patchify2d_cx(
    cx: dict[str, int], w_in: int, w_out: int, k: int, *, bias: bool = True
) -> dict[str, int]:
    """Complexity of `patchify2d`."""
    h, w = cx["h"] // k, cx["w"] // k
    flops = cx["flops"] + k * k * w_in * w_out * h * w + (w_out * h * w if bias else 0)
    params = cx["params"] + k * k * w_in * w_out + (w_out if bias else 0)
    acts = cx["acts"] + w_out * h * w
    return {"h": h, "w": w, "flops": flops, "params": params, "acts": acts}


def norm2d(w_in: int, eps: float, momentum: float) -> nn.BatchNorm2d:
    """BatchNorm2d."""
    return nn.BatchNorm2d(w_in, eps=eps, momentum=momentum)


def norm2d_cx(cx: dict[str, int], w_in: int) -> dict[str, int]:
    """Complexity of `norm2d` (parameters only, as pycls counts it)."""
    return {**cx, "params": cx["params"] + 2 * w_in}


def layernorm(w_in: int, eps: float) -> nn.LayerNorm:
    """LayerNorm over the last (hidden) dimension."""
    return nn.LayerNorm(w_in, eps=eps)


def layernorm_cx(cx: dict[str, int], w_in: int) -> dict[str, int]:
    """Complexity of `layernorm` (parameters only, as pycls counts it)."""
    return {**cx, "params": cx["params"] + 2 * w_in}


def linear(w_in: int, w_out: int, *, bias: bool = True) -> nn.Linear:
    """Linear layer."""
    return nn.Linear(w_in, w_out, bias=bias)


def linear_cx(
    cx: dict[str, int],
    w_in: int,
    w_out: int,
    *,
    bias: bool = True,
    num_locations: int = 1,
) -> dict[str, int]:
    """Complexity of `linear` applied at `num_locations` positions (tokens)."""
    flops = cx["flops"] + (w_in * w_out + (w_out if bias else 0)) * num_locations
    params = cx["params"] + w_in * w_out + (w_out if bias else 0)
    acts = cx["acts"] + w_out * num_locations
    return {**cx, "flops": flops, "params": params, "acts": acts}


def drop_path(
    x: torch.Tensor, drop_prob: float, training: bool, batch_dim: int
) -> torch.Tensor:
    """Stochastic depth: zeroes whole samples of a residual branch, rescales the rest.

    x: any tensor whose dimension `batch_dim` indexes samples; returns the same shape
    and dtype.
    """
    if drop_prob == 0.0 or not training:
        return x
    keep = 1.0 - drop_prob
    shape = [1] * x.ndim
    shape[batch_dim] = x.shape[batch_dim]
    mask = x.new_empty(shape).bernoulli_(keep)
    return x * mask.div_(keep)
