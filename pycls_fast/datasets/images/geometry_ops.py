"""Pillow's affine warps on uint8 (H, W, 3) RGB tensors: `Image.transform(AFFINE)` and
`Image.rotate` with bilinear or bicubic resampling and a fill colour, as timm's
rotate, shear and translate ops call them, without holding the GIL for their work.

Pillow maps each output pixel centre (x + 0.5, y + 0.5) through the matrix in double
precision, fills the pixel when the source point lies outside [0, W) x [0, H), and
otherwise interpolates the source around it (edges extended) with its bilinear or its
bicubic (a = -1) kernel, then truncates.

Shears and translations move each row (or column) by one offset. They are torch ops:
one interpolation along the axis with each line's weights, then one gather that shifts
the lines (`_shift_lines`), several times cheaper than Pillow's per-pixel loop. The
source points and the filled pixels are Pillow's (its double arithmetic); the
interpolation runs in float32, which moves a value by less than 1e-3 (255 times a few
float32 roundings of weights below 1.5 in sum), so a pixel differs from Pillow's by at
most 1, and only where Pillow's double value lies that close to an integer.

Rotations (and any other matrix) need 4 or 16 taps gathered per pixel with per-pixel
weights: torch ops take about three times Pillow's CPU for that (docs/PERFORMANCE.md,
"Augmentation cost per recipe"). They run Pillow's own C transform, whose loop
releases the GIL, between this thread's RGBX buffers (pillow_buffers.py): the same
pixels, exactly.
"""

import math
import threading

import numpy as np
import torch

from pycls_fast.datasets.images import pillow_buffers

BILINEAR = 2  # PIL.Image.Resampling.BILINEAR
BICUBIC = 3  # PIL.Image.Resampling.BICUBIC
# Edge pixels added on each side of the source: the bicubic taps of an inside point
# reach two pixels past the edge.
_PAD = 2
# Interpolation weights of the taps as polynomials in the fraction d: tap weights =
# coefficients @ (1, d, d^2, d^3). Bilinear: taps 0, 1 of the anchor; bicubic (a = -1,
# Geometry.c's BICUBIC): taps -1, 0, 1, 2.
_KERNELS = {
    BILINEAR: np.array([[1.0, -1.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]]),
    BICUBIC: np.array(
        [
            [0.0, -1.0, 2.0, -1.0],
            [1.0, 0.0, -2.0, 1.0],
            [0.0, 1.0, 1.0, -1.0],
            [0.0, 0.0, -1.0, 1.0],
        ]
    ),
}


class _Scratch(threading.local):
    """Per-thread buffers: the shifts' fill margins and index ramps, one per shape
    (and colour)."""

    def __init__(self):
        self.lines = {}
        self.ramps = {}


_scratch = _Scratch()


def _check(resample):
    if resample not in (BILINEAR, BICUBIC):
        raise ValueError(f"resample {resample!r}: BILINEAR (2) or BICUBIC (3)")


def kernel_weights(d: np.ndarray, resample: int) -> np.ndarray:
    """Pillow's interpolation weights (taps, len(d)) for fractions `d` (float64)."""
    powers = np.asarray(d, dtype=np.float64)[None] ** np.arange(4)[:, None]
    return _KERNELS[resample] @ powers


def _padded(img: torch.Tensor, axis: int) -> torch.Tensor:
    """float32 copy of `img` with _PAD edge pixels added on both sides of `axis`."""
    n = img.shape[axis]
    shape = list(img.shape)
    shape[axis] = n + 2 * _PAD
    out = torch.empty(shape, dtype=torch.float32)
    out.narrow(axis, _PAD, n).copy_(img)
    edge = list(img.shape)
    edge[axis] = _PAD
    out.narrow(axis, 0, _PAD).copy_(img.narrow(axis, 0, 1).expand(edge))
    out.narrow(axis, n + _PAD, _PAD).copy_(img.narrow(axis, n - 1, 1).expand(edge))
    return out


def _interpolate_lines(img, axis, frac, resample) -> torch.Tensor:
    """float32 values at anchors q = -1 .. n - 1 plus the fraction along `axis` (n + 1
    of them): `frac` is one fraction for all lines (a float) or one per line of the
    other axis (float64 array). Taps beyond the edges repeat the edge pixel."""
    n = img.shape[axis]
    src = _padded(img, axis)
    first = _PAD - 1 if resample == BILINEAR else _PAD - 2  # tap 0 of anchor -1
    weights = kernel_weights(frac, resample)  # (taps, lines)
    if np.ndim(frac) == 0:
        per_line = [float(w) for w in weights[:, 0]]
    else:
        weights = weights.astype(np.float32)
        if axis == 0:  # one weight per column, spelled out per channel
            weights = np.repeat(weights, 3, axis=1)
        per_line = torch.from_numpy(weights)
        per_line = per_line[:, :, None, None] if axis == 1 else per_line[:, None]
    out = None
    for t in range(len(weights)):
        tap = src.narrow(axis, first + t, n + 1)
        if axis == 0 and not isinstance(per_line, list):
            tap = tap.reshape(n + 1, -1)
        w = per_line[t]
        if out is None:
            out = torch.mul(tap, w)
        elif isinstance(w, float):
            out.add_(tap, alpha=w)
        else:
            out.addcmul_(tap, w)
    return out.view(src.shape[0] if axis == 1 else n + 1, -1, 3)


def _valid_range(n: int, shift: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per line, [lo, hi): the outputs i in [0, n) whose source coordinate
    fl(i + 0.5 + shift) Pillow finds inside [0, n) (in its double arithmetic;
    rounding is monotone, so each is an interval, and the real-number bounds are at
    most one off the floating-point ones)."""
    # Row 0: the lowest inside output (first with fl(i + 0.5 + shift) >= 0); row 1:
    # the first outside one above (fl(i + 0.5 + shift) >= n).
    edges = np.array([[0.0], [float(n)]])
    bound = np.ceil(edges - 0.5 - shift)
    bound -= (bound - 0.5) + shift >= edges
    bound += (bound + 0.5) + shift < edges
    lo, hi = np.clip(bound, 0, n).astype(np.int64)
    return lo, np.maximum(hi, lo)


def _fill_u8(fill) -> torch.Tensor:
    return torch.tensor([int(v) for v in fill], dtype=torch.uint8)


def _warp_1d(img, axis, shift, resample, fill) -> torch.Tensor:
    """Pillow's transform of `img` whose source coordinate along `axis` is
    fl(i + 0.5 + shift) (one shift per line of the other axis, or one for all) and is
    the output's along the other axis."""
    _check(resample)
    n = img.shape[axis]
    if np.ndim(shift) == 0:
        whole = math.floor(shift)
        lo, hi = (int(bound[0]) for bound in _valid_range(n, np.float64(shift)))
        values = _interpolate_lines(img, axis, shift - whole, resample)
        return _shift_all(values, axis, whole, lo, hi, fill)
    whole = np.floor(shift)
    lo, hi = _valid_range(n, shift)
    values = _interpolate_lines(img, axis, shift - whole, resample)
    return _shift_lines(values, axis, whole.astype(np.int64), lo, hi, fill)


def _shift_all(values, axis, whole, lo, hi, fill) -> torch.Tensor:
    """Every line moved by `whole`: output i is anchor i + whole (index i + whole + 1
    of `values`) for i in [lo, hi); the rest is filled."""
    n = values.shape[axis] - 1
    shape = list(values.shape)
    shape[axis] = n
    out = torch.empty(shape, dtype=torch.uint8)
    colour = _fill_u8(fill)
    for start, stop in ((0, lo), (hi, n)):
        if stop > start:
            part = out.narrow(axis, start, stop - start)
            part.copy_(colour.expand(part.shape))
    if hi > lo:
        inside = values.narrow(axis, lo + whole + 1, hi - lo).clamp_(0, 255)
        out.narrow(axis, lo, hi - lo).copy_(inside.to(torch.int16))
    return out


def _lines_buffer(values_shape, axis, fill) -> tuple[torch.Tensor, int]:
    """This thread's uint8 buffer for `_shift_lines`: the n + 1 interpolated values of
    each line between margins of n + 1 fill pixels (any shift of the n outputs lands in
    it), and the margin's width. The margins are written once."""
    key = (tuple(values_shape), axis, tuple(int(v) for v in fill))
    margin = values_shape[axis]
    buf = _scratch.lines.get(key)
    if buf is None:
        shape = list(values_shape)
        shape[axis] = 3 * margin
        buf = torch.empty(shape, dtype=torch.uint8)
        buf.view(-1, 3).copy_(_fill_u8(fill).expand(buf.numel() // 3, 3))
        _scratch.lines[key] = buf
    return buf, margin


def _ramp(length: int) -> torch.Tensor:
    ramp = _scratch.ramps.get(length)
    if ramp is None:
        ramp = _scratch.ramps[length] = torch.arange(length, dtype=torch.int32)
    return ramp


def _shift_lines(values, axis, whole, lo, hi, fill) -> torch.Tensor:
    """Line j moved by `whole[j]`: output i of line j is anchor i + whole[j] of
    `values` for i in [lo[j], hi[j]), the fill colour elsewhere. One gather from a
    buffer where `values` sits between fill margins: an output outside its line's
    range lands in a margin or on one of the two end anchors (-1 and n - 1), which
    are filled on the lines whose inside outputs do not use them."""
    n = values.shape[axis] - 1
    lines = len(whole)
    buf, margin = _lines_buffer(values.shape, axis, fill)
    inside = buf.narrow(axis, margin, n + 1)
    inside.copy_(values.clamp_(0, 255).to(torch.int16))
    # The end anchors to fill: (line, anchor index margin or margin + n).
    line_len = buf.shape[axis]
    first = np.flatnonzero(lo + whole != -1)
    last = np.flatnonzero(hi - 1 + whole != n - 1)
    ends = np.concatenate((first, last))
    anchors = np.repeat([margin, margin + n], [len(first), len(last)])
    cells = ends * line_len + anchors if axis == 1 else anchors * lines + ends
    if len(cells):
        pixels = buf.view(-1, 3)
        pixels.index_copy_(
            0, torch.from_numpy(cells), _fill_u8(fill).expand(len(cells), 3)
        )
    whole = np.clip(whole, -(n + 1), n + 1)  # beyond that a line is all fill anyway
    if axis == 1:  # row j's output i: column margin + 1 + i + whole[j]
        start = (np.arange(lines) * line_len + margin + 1 + whole) * 3
        index = torch.from_numpy(start.astype(np.int32)).view(-1, 1) + _ramp(n * 3)
        return torch.index_select(buf.view(-1), 0, index.view(-1)).view(lines, n, 3)
    # column j's output i: row margin + 1 + i + whole[j] (pixel index; its 3 bytes
    # are gathered as one row of the (pixels, 3) view)
    start = (margin + 1 + whole) * lines + np.arange(lines)
    index = _ramp(n).view(-1, 1) * lines + torch.from_numpy(start.astype(np.int32))
    pixels = torch.index_select(buf.view(-1, 3), 0, index.view(-1))
    return pixels.view(n, lines, 3)


def translate_x(img: torch.Tensor, pixels: float, resample: int, fill) -> torch.Tensor:
    """`img.transform(size, AFFINE, (1, 0, pixels, 0, 1, 0), resample,
    fillcolor=fill)`."""
    return _warp_1d(img, 1, float(pixels), resample, fill)


def translate_y(img: torch.Tensor, pixels: float, resample: int, fill) -> torch.Tensor:
    """`img.transform(size, AFFINE, (1, 0, 0, 0, 1, pixels), resample,
    fillcolor=fill)`."""
    return _warp_1d(img, 0, float(pixels), resample, fill)


def shear_x(img: torch.Tensor, factor: float, resample: int, fill) -> torch.Tensor:
    """`img.transform(size, AFFINE, (1, factor, 0, 0, 1, 0), resample, fillcolor=fill)`:
    row y moves by factor x (y + 0.5)."""
    rows = np.arange(img.shape[0], dtype=np.float64) + 0.5
    return _warp_1d(img, 1, factor * rows, resample, fill)


def shear_y(img: torch.Tensor, factor: float, resample: int, fill) -> torch.Tensor:
    """`img.transform(size, AFFINE, (1, 0, 0, factor, 1, 0), resample, fillcolor=fill)`:
    column x moves by factor x (x + 0.5)."""
    columns = np.arange(img.shape[1], dtype=np.float64) + 0.5
    return _warp_1d(img, 0, factor * columns, resample, fill)


def rotation_matrix(degrees: float, width: int, height: int) -> list[float]:
    """The source-from-output matrix of `Image.rotate(degrees)` about the centre
    (Pillow's own arithmetic, `round(..., 15)` included)."""
    angle = -math.radians(degrees % 360.0)
    cos, sin = round(math.cos(angle), 15), round(math.sin(angle), 15)
    matrix = [cos, sin, 0.0, round(-math.sin(angle), 15), cos, 0.0]
    cx, cy = width / 2, height / 2
    a, b, c, d, e, f = matrix
    matrix[2] = a * -cx + b * -cy + c + cx
    matrix[5] = d * -cx + e * -cy + f + cy
    return matrix


def rotate(img: torch.Tensor, degrees: float, resample: int, fill) -> torch.Tensor:
    """`img.rotate(degrees, resample, fillcolor=fill)` (counter-clockwise, about the
    centre, same size), with Pillow's shortcuts for 0, 90, 180 and 270."""
    angle = degrees % 360.0
    h, w = img.shape[:2]
    if angle == 0:
        return img.clone()
    if angle == 180:
        return torch.flip(img, (0, 1))
    if angle in (90, 270) and w == h:
        return torch.rot90(img, 1 if angle == 90 else -1, (0, 1)).contiguous()
    return affine(img, rotation_matrix(degrees, w, h), resample, fill)


def affine(img: torch.Tensor, matrix, resample: int, fill) -> torch.Tensor:
    """`img.transform(size, AFFINE, matrix, resample, fillcolor=fill)` for any matrix
    (a, b, c, d, e, f): the source of output (x, y) is (a x' + b y' + c, d x' + e y' +
    f) with x' = x + 0.5, y' = y + 0.5. Pillow's own transform, on RGBX copies."""
    _check(resample)
    h, w = img.shape[:2]
    (src, src_im), (dst, dst_im) = pillow_buffers.rgbx_images(h, w)
    src[..., :3].copy_(img)
    dst.view(torch.int32).fill_(pillow_buffers.packed(fill))
    matrix = [float(v) for v in matrix[:6]]
    pillow_buffers.transform_into(dst_im, src_im, matrix, resample)
    return pillow_buffers.rgb_from(dst)
