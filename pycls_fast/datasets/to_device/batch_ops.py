"""Pillow's point, colour and affine operations on a uint8 batch, one parameter per
image: timm's AutoAugment / RandAugment ops for TRAIN.AUGMENT_BACKEND device.

Every function takes uint8 (N, 3, H, W) images on any device and per-image parameters
as tensors of N values on the same device, and returns the images that Pillow returns
for each image and its parameter (timm's op functions on PIL images). No function
reads a value back to the host, so on a GPU none waits for the device.

How each stays equal to Pillow (the single-image forms in images/pixel_ops.py and
images/geometry_ops.py explain the same arithmetic on the host):
- Point ops (invert, posterize, solarize, solarize-add) are the same integer functions;
  autocontrast and equalize build Pillow's tables per image and channel (equalize's
  from per-image histograms), in float64 and int64 as Pillow's Python does.
- Every division is of a tensor by a tensor: torch computes `number / tensor` as a
  reciprocal times the number, and CUDA `tensor / number` as a product with the
  number's reciprocal, each rounded twice.
- Blends repeat Pillow's float32 `in1 + alpha * (in2 - in1)`, one rounding per
  operation (separate kernels: no fused multiply-add), truncated and clipped; luma is
  Pillow's 16-bit fixed point in int32; SMOOTH (sharpness) the integer
  `(2 S + 13) // 26` of its weighted sum S.
- Affine warps (rotate, shear, translate) follow Geometry.c pixel by pixel in float64:
  the source point `a x' + b y' + c` of the pixel centre, the fill outside
  [0, W) x [0, H), taps clamped at the edges, the bilinear or the bicubic (a = -1)
  polynomial evaluated in Pillow's order of operations, then truncation. Each
  operation is one IEEE double rounding, as Pillow's C (built without fused
  multiply-add) rounds it, so the pixels are Pillow's exactly.
"""

import numpy as np
import torch

from pycls_fast.datasets.images.pixel_ops import to_uint8

BILINEAR = 2  # PIL.Image.Resampling.BILINEAR
BICUBIC = 3  # PIL.Image.Resampling.BICUBIC


def _per_image(values: torch.Tensor) -> torch.Tensor:
    """(N,) -> (N, 1, 1, 1), to broadcast over an image."""
    return values.view(-1, 1, 1, 1)


def invert(x: torch.Tensor) -> torch.Tensor:
    """ImageOps.invert: 255 - v."""
    return torch.bitwise_not(x)


def posterize(x: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """ImageOps.posterize keeping `bits` (int64 (N,)) bits; <= 0 clears every bit
    (Pillow before 13, timm's posterize-0), >= 8 keeps the image."""
    shift = (8 - bits).clamp(0, 8)
    mask = torch.bitwise_left_shift(torch.full_like(shift, 255), shift) & 255
    return x & _per_image(mask.to(torch.uint8))


def solarize(x: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """ImageOps.solarize: values >= `threshold` (float64 (N,)) become 255 - v."""
    t = _per_image(torch.ceil(threshold).clamp(-1, 256).to(torch.int16))
    return torch.where(x.to(torch.int16) >= t, torch.bitwise_not(x), x)


def solarize_add(
    x: torch.Tensor, add: torch.Tensor, threshold: int = 128
) -> torch.Tensor:
    """timm's solarize_add: min(255, v + `add`) (int64 (N,)) where v < `threshold`,
    clipped at 0 for a negative `add` (Pillow's 8-bit table)."""
    v = x.to(torch.int16)
    added = (v + _per_image(add.to(torch.int16))).clamp_(0, 255).to(torch.uint8)
    return torch.where(v < threshold, added, x)


def blend(
    degenerate: torch.Tensor, x: torch.Tensor, factor: torch.Tensor
) -> torch.Tensor:
    """Image.blend(degenerate, x, factor) per image: `degenerate + factor x (x -
    degenerate)` in float32 (`factor`: float32 (N,)), truncated and clipped.
    `degenerate`: float32 of integer values, broadcastable to `x`."""
    out = x.to(torch.float32).sub_(degenerate)
    out.mul_(_per_image(factor)).add_(degenerate)
    return to_uint8(out)


def brightness(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """ImageEnhance.Brightness: a blend with black."""
    return to_uint8(x.to(torch.float32).mul_(_per_image(factor)))


def luma(x: torch.Tensor) -> torch.Tensor:
    """Pillow's RGB -> L: int32 (N, 1, H, W), `(19595 R + 38470 G + 7471 B + 2^15)
    >> 16`."""
    v = x.to(torch.int32)
    total = v[:, 0:1] * 19595 + v[:, 1:2] * 38470
    total += v[:, 2:3] * 7471
    return (total + 32768) >> 16


def color(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """ImageEnhance.Color: a blend with the image's luma (0: grayscale)."""
    return blend(luma(x).to(torch.float32), x, factor)


def contrast(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """ImageEnhance.Contrast: a blend with the uniform image of the mean luma, rounded
    as ImageStat's `int(sum / count + 0.5)`."""
    h, w = x.shape[-2:]
    total = luma(x).sum(dim=(1, 2, 3), dtype=torch.int64).to(torch.float64)
    # Over a tensor, not a number: CUDA divides by a number as a product with its
    # reciprocal, which is not Python's correctly rounded quotient.
    mean = torch.floor(total / torch.full_like(total, h * w) + 0.5)
    mean = mean.to(torch.float32)
    return blend(_per_image(mean), x, factor)


def sharpness(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """ImageEnhance.Sharpness: a blend with ImageFilter.SMOOTH's image (ones around a
    5, over 13), whose one-pixel border is the image's own."""
    h, w = x.shape[-2:]
    if h < 3 or w < 3:
        return x
    v = x.to(torch.int32)
    rows = v[..., :-2] + v[..., 1:-1] + v[..., 2:]
    total = rows[..., :-2, :] + rows[..., 1:-1, :] + rows[..., 2:, :]
    total += 4 * v[..., 1:-1, 1:-1]
    smooth = torch.div(2 * total + 13, 26, rounding_mode="floor")
    out = x.clone()
    out[..., 1:-1, 1:-1] = blend(smooth.to(torch.float32), x[..., 1:-1, 1:-1], factor)
    return out


def autocontrast(x: torch.Tensor) -> torch.Tensor:
    """ImageOps.autocontrast (no cutoff): per image and channel, Pillow's table
    `int(v * scale + offset)` taking the lowest value to 0 and the highest to 255."""
    low = x.amin(dim=(2, 3), keepdim=True).to(torch.float64)
    high = x.amax(dim=(2, 3), keepdim=True).to(torch.float64)
    spread = high - low
    # A tensor over a tensor: `255.0 / t` is torch's reciprocal times 255, rounded
    # twice.
    scale = torch.full_like(spread, 255.0) / torch.where(spread > 0, spread, 1.0)
    offset = torch.neg(low) * scale
    out = torch.trunc(x.to(torch.float64) * scale + offset).clamp_(0, 255)
    return torch.where(spread > 0, out.to(torch.uint8), x)


def equalize(x: torch.Tensor) -> torch.Tensor:
    """ImageOps.equalize: per image and channel, Pillow's table `(step // 2 + below)
    // step` from the histogram, step = (pixels - the top value's count) // 255."""
    n, c, h, w = x.shape
    flat = x.reshape(n * c, h * w).to(torch.int64)
    # scatter_add_, not bincount: CUDA's bincount reads its input's max back to the
    # host to size its output.
    hist = torch.zeros(n * c, 256, dtype=torch.int64, device=x.device)
    hist.scatter_add_(1, flat, torch.ones_like(flat))
    top = 255 - (hist > 0).flip(1).to(torch.uint8).argmax(1, keepdim=True)
    step = (h * w - hist.gather(1, top)) // 255
    below = hist.cumsum(1) - hist
    table = (step // 2 + below) // step.clamp(min=1)
    identity = torch.arange(256, device=x.device).expand_as(table)
    table = torch.where(step > 0, table.clamp_(0, 255), identity).to(torch.uint8)
    return table.gather(1, flat).view(n, c, h, w)


def _cubic(v1, v2, v3, v4, d):
    """Geometry.c's BICUBIC: p1 + d (p2 + d (p3 + d p4)) in its order, float64."""
    p2 = torch.neg(v1).add_(v3)
    p3 = torch.sub(v1, v2).mul_(2.0).add_(v3).sub_(v4)
    p4 = torch.neg(v1).add_(v2).sub_(v3).add_(v4)
    return p4.mul_(d).add_(p3).mul_(d).add_(p2).mul_(d).add_(v2)


def _linear(v1, v2, d):
    """Geometry.c's BILINEAR: v1 + (v2 - v1) d, float64."""
    return torch.sub(v2, v1).mul_(d).add_(v1)


def affine(
    x: torch.Tensor, matrices: torch.Tensor, resample: int, fill: torch.Tensor
) -> torch.Tensor:
    """`Image.transform(size, AFFINE, matrix, resample, fillcolor=fill)` per image.

    `matrices`: float64 (N, 6), (a, b, c, d, e, f): output (x, y) samples the source
    at (a x' + b y' + c, d x' + e y' + f), x' = x + 0.5, y' = y + 0.5; `resample`
    BILINEAR or BICUBIC; `fill`: uint8 (3,), the colour where the source point lies
    outside the image.
    """
    if resample not in (BILINEAR, BICUBIC):
        raise ValueError(f"resample {resample!r}: BILINEAR (2) or BICUBIC (3)")
    n, c, h, w = x.shape
    kw = {"dtype": torch.float64, "device": x.device}
    xs = (torch.arange(w, **kw) + 0.5).view(1, 1, w)
    ys = (torch.arange(h, **kw) + 0.5).view(1, h, 1)
    a, b, cc, d, e, f = (m.view(n, 1, 1) for m in matrices.unbind(1))
    src_x = (a * xs + b * ys) + cc  # Pillow's a0 * xin + a1 * yin + a2
    src_y = (d * xs + e * ys) + f
    inside = (src_x >= 0) & (src_x < w) & (src_y >= 0) & (src_y < h)
    src_x, src_y = src_x - 0.5, src_y - 0.5
    # Outside points get anchors in range (their pixels are filled anyway).
    col = torch.floor(src_x).clamp_(-4, w + 4)
    row = torch.floor(src_y).clamp_(-4, h + 4)
    dx, dy = (src_x - col).view(n, 1, -1), (src_y - row).view(n, 1, -1)
    taps = 4 if resample == BICUBIC else 2
    first = -1 if resample == BICUBIC else 0
    col, row = col.to(torch.int64) + first, row.to(torch.int64) + first
    cols = [(col + k).clamp_(0, w - 1) for k in range(taps)]
    pixels = x.reshape(n, c, h * w)
    combine = _cubic if resample == BICUBIC else _linear
    lines = []
    for r in range(taps):
        base = (row + r).clamp_(0, h - 1) * w
        values = [
            pixels.gather(2, (base + k).view(n, 1, -1).expand(n, c, -1)).double()
            for k in cols
        ]
        lines.append(combine(*values, dx))
    out = combine(*lines, dy).view(n, c, h, w)
    out = to_uint8(out)
    return torch.where(inside.view(n, 1, h, w), out, fill.view(1, c, 1, 1))


def grayscale(x: torch.Tensor) -> torch.Tensor:
    """`convert("L")` merged into three equal channels (DeiT III's grayscale)."""
    return luma(x).to(torch.uint8).expand_as(x).contiguous()


def box_blur_radius(radius: float, passes: int = 3) -> float:
    """Pillow's box radius for `GaussianBlur(radius)` (BoxBlur.c's
    `_gaussian_blur_radius`): float32 arithmetic, its two steps in double."""
    f = np.float32
    sigma2 = f(f(radius) * f(radius)) / f(passes)
    length = f(np.sqrt(12.0 * float(sigma2) + 1.0))
    whole = f(np.floor((float(length) - 1.0) / 2.0))
    a = (f(2) * whole + f(1)) * (whole * (whole + f(1)) - f(3) * sigma2)
    a = a / (f(6) * (sigma2 - (whole + f(1)) * (whole + f(1))))
    return float(f(whole + a))


def box_weights(box_radius: float) -> tuple[int, int, int]:
    """(integer radius, weight of the inner taps, weight of the two outer taps) of
    Pillow's fixed-point box (ImagingHorizontalBoxBlur: 24-bit weights)."""
    f = np.float32
    whole = int(box_radius)
    inner = int(f(1 << 24) / (f(f(box_radius) * f(2)) + f(1)))
    outer = ((1 << 24) - (whole * 2 + 1) * inner) // 2
    return whole, inner, outer


def _box_pass(v: torch.Tensor, radius, inner, outer, pad: int) -> torch.Tensor:
    """One ImagingLineBoxBlur pass along the last axis of int64 `v` (N, C, H, W):
    per image, (sum of the 2 r + 1 taps around x) x inner + (the taps at x - r - 1
    and x + r + 1) x outer, rounded off 24 bits; taps past the edges repeat it."""
    n, c, h, w = v.shape
    padded = torch.cat(
        [v[..., :1].expand(n, c, h, pad), v, v[..., -1:].expand(n, c, h, pad)], dim=3
    )
    sums = torch.nn.functional.pad(padded.cumsum(3), (1, 0))
    x = torch.arange(w, device=v.device).view(1, 1, 1, w) + pad
    r = radius.view(n, 1, 1, 1)
    shape = (n, c, h, w)
    window = sums.gather(3, (x + r + 1).expand(shape)) - sums.gather(
        3, (x - r).expand(shape)
    )
    far = padded.gather(3, (x - r - 1).expand(shape)) + padded.gather(
        3, (x + r + 1).expand(shape)
    )
    bulk = window * inner.view(n, 1, 1, 1) + far * outer.view(n, 1, 1, 1)
    return (bulk + (1 << 23)) >> 24


def gaussian_blur(
    x: torch.Tensor,
    radius: torch.Tensor,
    inner: torch.Tensor,
    outer: torch.Tensor,
    max_radius: int,
) -> torch.Tensor:
    """ImageFilter.GaussianBlur per image (a radius whose box radius is not 0):
    Pillow's three box passes along rows, then three along columns, each rounded to
    8 bits. `radius`, `inner`, `outer`: int64 (N,) from
    `box_weights(box_blur_radius(r))` on the host; `max_radius`: the largest of
    `radius` (known on the host: reading it here would wait for the device)."""
    pad = max_radius + 1
    v = x.to(torch.int64)
    for _ in range(3):
        v = _box_pass(v, radius, inner, outer, pad)
    v = v.transpose(2, 3)
    for _ in range(3):
        v = _box_pass(v, radius, inner, outer, pad)
    return v.transpose(2, 3).to(torch.uint8).contiguous()
