"""Pillow's point, colour and filter operations on uint8 (H, W, 3) RGB tensors.

Each function returns the pixels that its Pillow counterpart returns for the same image
(`ImageOps.invert / posterize / solarize / autocontrast / equalize`, timm's
`solarize_add`, `ImageEnhance.Brightness / Contrast / Color / Sharpness`, the "L"
conversion, `ImageFilter.GaussianBlur`): timm's AutoAugment / RandAugment ops and DeiT
III's 3-Augment and colour jitter are built from these. They are written with torch
ops, which release the GIL while they work, so the decoding threads that run them do not
stop the training thread; Pillow holds it for parts of these operations (its blends,
`Image.merge`, ImageStat's Python).

How each stays equal to Pillow:
- Lookup tables (posterize, solarize, autocontrast, equalize) are Pillow's own, built
  the way ImageOps builds them, or the same integer function.
- Blends (`ImageEnhance`, `Image.blend`) repeat Pillow's float32 arithmetic
  `in1 + alpha * (in2 - in1)`, one rounding per operation, then truncation (and
  clipping when extrapolating); no fused multiply-add, which would round once.
- Luma ("L") is Pillow's fixed point `(19595 R + 38470 G + 7471 B + 2^15) >> 16`, whose
  terms are integers below 2^24, exact in float32.
- SMOOTH (Sharpness) is Pillow's float 3x3 kernel, whose value lies at least 1/26 from
  the next integer (the kernel's sum is 13, and 0.5 is added before truncating), so it
  equals the integer `(2 S + 13) // 26` of the weighted sum S.
- Gaussian blur runs Pillow's own C box passes on this thread's RGBX buffers
  (pillow_buffers.py), which release the GIL.

Work on whole contiguous tensors: on CPUs without vectorized paths for them, torch ops
over strided channel slices or broadcasts along the 3-channel axis run several times
slower than over flat data (docs/PERFORMANCE.md, "Augmentation cost per recipe").
"""

import math
import threading

import numpy as np
import torch

from pycls_fast.datasets.images import pillow_buffers

# Pillow's ITU-R 601-2 luma in 16-bit fixed point (Convert.c, L24), as a (3, 3) matrix
# whose every column holds the weights: (N, 3) @ it gives each pixel's L in all three
# channels (the "L" image converted back to RGB).
_LUMA_RGB = torch.tensor([19595.0, 38470.0, 7471.0])[:, None].expand(3, 3).contiguous()
_SMOOTH_CENTER = 5  # ImageFilter.SMOOTH: ones around a 5, divided by 13


class _Patterns(threading.local):
    """Per-thread cached index patterns, one per image size."""

    def __init__(self):
        self.channel_offsets = {}


_patterns = _Patterns()


def _channel_offsets(numel: int) -> torch.Tensor:
    """int32 (numel,): 0, 256, 512 repeated, the per-channel offsets into a (3, 256)
    table for a flat (H, W, 3) image."""
    offsets = _patterns.channel_offsets.get(numel)
    if offsets is None:
        offsets = torch.tensor([0, 256, 512], dtype=torch.int32).repeat(numel // 3)
        _patterns.channel_offsets[numel] = offsets
    return offsets


def to_uint8(x: torch.Tensor) -> torch.Tensor:
    """Clips float32 `x` to [0, 255] in place and truncates it to uint8, as Pillow's
    `(UINT8)` casts and CLIP8 do (values are non-negative after the clip, so the
    truncation toward zero is a floor)."""
    # Through int16: two vectorized conversions beat torch's float -> uint8 loop.
    return x.clamp_(0, 255).to(torch.int16).to(torch.uint8)


def invert(img: torch.Tensor) -> torch.Tensor:
    """ImageOps.invert: 255 - v."""
    return torch.bitwise_not(img)


def posterize(img: torch.Tensor, bits: int) -> torch.Tensor:
    """ImageOps.posterize keeping the `bits` most significant bits of each value.

    `bits` <= 0 clears every bit, which is what Pillow before 13 gave for 0 (its mask
    ~(2^8 - 1)); Pillow 13 raises ValueError instead. `bits` >= 8: unchanged (timm).
    """
    if bits >= 8:
        return img
    mask = (0xFF << (8 - bits)) & 0xFF if bits > 0 else 0
    return torch.bitwise_and(img, mask)


def solarize(img: torch.Tensor, threshold: float) -> torch.Tensor:
    """ImageOps.solarize: values >= `threshold` become 255 - v."""
    threshold = math.ceil(threshold)  # v < t for an integer v is v < ceil(t)
    if threshold <= 0:
        return invert(img)
    if threshold > 255:
        return img
    # 1 where v >= threshold, else 0; times 255 it is the XOR mask of 255 - v.
    flip = torch.clamp(img, threshold - 1, threshold)
    flip.sub_(threshold - 1).mul_(255)
    return flip.bitwise_xor_(img)


def solarize_add(img: torch.Tensor, add: int, threshold: int = 128) -> torch.Tensor:
    """timm's solarize_add: min(255, v + `add`) where v < `threshold`."""
    if threshold <= 0 or add == 0:
        return img
    threshold = min(threshold, 256)
    if add < 0 or threshold - 1 + add > 255:  # would saturate: Pillow's table
        values = np.arange(256)
        table = np.where(values < threshold, np.minimum(255, values + add), values)
        return apply_lut(img, table)
    # 1 where v < threshold, else 0 (no value can pass 255: checked above).
    below = torch.clamp(img, threshold - 1, threshold)
    below = torch.sub(threshold, below, out=below).mul_(add)
    return below.add_(img)


def apply_lut(img: torch.Tensor, table) -> torch.Tensor:
    """Pillow's `point` with `table`: 256 values for every channel or (3, 256), one
    row per channel; values are clipped to [0, 255] as Pillow's 8-bit tables are."""
    table = np.clip(np.asarray(table), 0, 255).astype(np.uint8)
    index = img.reshape(-1).to(torch.int32)
    if table.ndim == 2:
        index.add_(_channel_offsets(index.numel()))
    flat = torch.from_numpy(np.ascontiguousarray(table).reshape(-1))
    return torch.index_select(flat, 0, index).view(img.shape)


def histogram(img: torch.Tensor) -> np.ndarray:
    """Pillow's `histogram()` of an RGB image: int64 (3, 256) counts per channel."""
    index = img.reshape(-1).to(torch.int32).add_(_channel_offsets(img.numel()))
    return torch.bincount(index, minlength=768).numpy().reshape(3, 256)


def autocontrast(img: torch.Tensor) -> torch.Tensor:
    """ImageOps.autocontrast (no cutoff): each channel's lowest value to 0 and highest
    to 255, through Pillow's table `int(v * scale + offset)`, clipped."""
    low, high = torch.aminmax(img.view(-1, 3), dim=0)
    tables = []
    values = np.arange(256, dtype=np.float64)
    for lo, hi in zip(low.tolist(), high.tolist()):
        if hi <= lo:
            tables.append(np.arange(256))
        else:
            scale = 255.0 / (hi - lo)
            offset = -lo * scale
            tables.append(np.trunc(values * scale + offset))
    return apply_lut(img, np.stack(tables))


def equalize(img: torch.Tensor) -> torch.Tensor:
    """ImageOps.equalize: per channel, Pillow's table from the cumulative histogram."""
    tables = []
    for h in histogram(img):
        used = h[h != 0]
        step = (int(used.sum()) - int(used[-1])) // 255 if len(used) > 1 else 0
        if not step:
            tables.append(np.arange(256))
            continue
        before = np.concatenate(([0], np.cumsum(h)[:-1]))  # pixels below each value
        tables.append((step // 2 + before) // step)
    return apply_lut(img, np.stack(tables))


def luma(img: torch.Tensor) -> torch.Tensor:
    """Pillow's RGB -> L, kept in all three channels (as `convert("L").convert("RGB")`
    gives it): float32 (H, W, 3) of integers in [0, 255]."""
    values = torch.mm(img.view(-1, 3).to(torch.float32), _LUMA_RGB)
    return values.add_(32768.0).mul_(2.0**-16).floor_().view(img.shape)


def grayscale(img: torch.Tensor) -> torch.Tensor:
    """`convert("L")` merged into three equal channels (DeiT III's grayscale)."""
    return to_uint8(luma(img))


def blend(
    degenerate: torch.Tensor | float, img: torch.Tensor, factor: float
) -> torch.Tensor:
    """Image.blend(degenerate, img, factor): `degenerate + factor x (img - degenerate)`
    in float32 (`factor` rounded to float32 as Pillow's C takes it), truncated; values
    outside [0, 255] (factor > 1) clipped. `degenerate`: a float32 tensor of `img`'s
    shape or a number (a uniform image)."""
    alpha = float(np.float32(factor))
    out = img.to(torch.float32)
    out.sub_(degenerate).mul_(alpha)
    return to_uint8(out.add_(degenerate))


def brightness(img: torch.Tensor, factor: float) -> torch.Tensor:
    """ImageEnhance.Brightness: a blend with black."""
    out = img.to(torch.float32).mul_(float(np.float32(factor)))
    return to_uint8(out)  # 0 + x is x: no addition needed


def contrast(img: torch.Tensor, factor: float) -> torch.Tensor:
    """ImageEnhance.Contrast: a blend with the uniform image of the rounded mean luma
    (ImageStat's mean of the "L" image: its integer sum over the pixel count)."""
    total = int(torch.sum(luma(img)[..., 0], dtype=torch.float64))
    mean = int(total / (img.shape[0] * img.shape[1]) + 0.5)
    return blend(float(mean), img, factor)


def color(img: torch.Tensor, factor: float) -> torch.Tensor:
    """ImageEnhance.Color: a blend with the image's luma (0: grayscale)."""
    return blend(luma(img), img, factor)


def sharpness(img: torch.Tensor, factor: float) -> torch.Tensor:
    """ImageEnhance.Sharpness: a blend with ImageFilter.SMOOTH's image, whose one-pixel
    border Pillow copies from the image (there the blend gives the image back)."""
    h, w = img.shape[:2]
    if h < 3 or w < 3:
        return img
    x = img.to(torch.float32)
    rows = x[:, :-2] + x[:, 1:-1]
    rows.add_(x[:, 2:])
    total = rows[:-2] + rows[1:-1]
    total.add_(rows[2:])
    center = x[1:-1, 1:-1]
    total.add_(center, alpha=_SMOOTH_CENTER - 1)  # integers: exact in any order
    smooth = total.mul_(2.0).add_(13.0).div_(26.0).floor_()  # Pillow's rounded SMOOTH
    out = img.clone()
    out[1:-1, 1:-1] = blend(smooth, img[1:-1, 1:-1], factor)
    return out


def gaussian_blur(img: torch.Tensor, radius: float) -> torch.Tensor:
    """ImageFilter.GaussianBlur(radius): Pillow's own box passes on this thread's
    RGBX buffers (pillow_buffers.py; as torch ops, three rounded box passes per axis
    took more CPU and many more Python calls than Pillow's C loop)."""
    if radius == 0:
        return img
    h, w = img.shape[:2]
    (src, src_im), (dst, dst_im) = pillow_buffers.rgbx_images(h, w)
    src[..., :3].copy_(img)
    pillow_buffers.gaussian_blur_into(dst_im, src_im, float(radius))
    return pillow_buffers.rgb_from(dst)
