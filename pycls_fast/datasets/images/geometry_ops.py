"""Pillow's affine warps on uint8 (H, W, 3) RGB tensors: `Image.transform(AFFINE)` and
`Image.rotate` with bilinear or bicubic resampling and a fill colour, as timm's
rotate, shear and translate ops call them, written with torch ops that release the
GIL.

Pillow maps each output pixel centre (x + 0.5, y + 0.5) through the matrix in double
precision, fills the pixel when the source point lies outside [0, W) x [0, H), and
otherwise interpolates the source around it (edges extended) with its bilinear or its
bicubic (a = -1) kernel, then truncates. Here the source points, which pixels are
filled and the kernel's taps are Pillow's, computed the same way; the interpolation
runs in float32, which moves a value by less than 1e-3 (255 times a few float32
roundings of weights below 1.6 in sum), so a pixel differs from Pillow's by at most 1,
and only where Pillow's double value lies that close to an integer.

Shears and translations move each row (or column) by one offset: they interpolate
along that axis once with the row's weights and then shift the rows by a single gather
(`_shift_lines`); rotations interpolate every pixel from its own 2 x 2 or 4 x 4 taps.
"""

import math
import threading

import numpy as np
import torch
import torch.nn.functional as F

BILINEAR = 2  # PIL.Image.Resampling.BILINEAR
BICUBIC = 3  # PIL.Image.Resampling.BICUBIC
# Edge pixels added on each side of the source: the bicubic taps of an inside point
# reach two pixels past the edge.
_PAD = 2


class _Scratch(threading.local):
    """Per-thread shift buffers with their fill margins, one per shape and colour."""

    def __init__(self):
        self.lines = {}


_scratch = _Scratch()


def _check(resample):
    if resample not in (BILINEAR, BICUBIC):
        raise ValueError(f"resample {resample!r}: BILINEAR (2) or BICUBIC (3)")


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


def kernel_weights(d: np.ndarray, resample: int) -> list[np.ndarray]:
    """Pillow's interpolation weights of the taps at offsets 0, 1 (bilinear) or -1, 0,
    1, 2 (bicubic, a = -1: Geometry.c's BICUBIC polynomial written per tap) from the
    anchor, for fractional positions `d` (float64 array)."""
    if resample == BILINEAR:
        return [1 - d, d]
    return [
        d * (-1 + d * (2 - d)),
        1 + d * d * (-2 + d),
        d * (1 + d * (1 - d)),
        d * d * (-1 + d),
    ]


def _interpolate_lines(
    img: torch.Tensor, axis: int, frac: np.ndarray, resample: int
) -> torch.Tensor:
    """float32 values at anchors q = -1 .. n - 1 plus `frac` along `axis` (n + 1 of
    them), each line of the other axis with its own fraction (`frac`: one per line, or
    one for all). Taps beyond the edges repeat the edge pixel."""
    n = img.shape[axis]
    src = _padded(img, axis)
    first = _PAD - 1 if resample == BILINEAR else _PAD - 2  # tap 0 of anchor -1
    frac = np.asarray(frac, dtype=np.float64)
    out = None
    for t, w in enumerate(kernel_weights(frac, resample)):
        tap = src.narrow(axis, first + t, n + 1)
        if w.ndim == 0:
            weight = float(w)
        elif axis == 1:  # one weight per row
            weight = torch.from_numpy(w.astype(np.float32)).view(-1, 1, 1)
        else:  # one weight per column, spelled out per channel (see pixel_ops)
            weight = torch.from_numpy(np.repeat(w.astype(np.float32), 3)).view(1, -1)
            tap = tap.reshape(n + 1, -1)
        if out is None:
            out = torch.mul(tap, weight)
        elif isinstance(weight, float):
            out.add_(tap, alpha=weight)
        else:
            out.addcmul_(tap, weight)
    if axis == 0:
        out = out.view(n + 1, img.shape[1], 3)
    return out


def _valid_range(n: int, shift: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per line, [lo, hi): the output positions i in [0, n) whose source coordinate
    fl(i + 0.5 + shift) Pillow finds inside [0, n), computed in its double arithmetic
    (rounding is monotone, so each set is an interval; the exact bounds are found by
    testing the candidates next to the real-number ones)."""
    shift = np.asarray(shift, dtype=np.float64)
    lo = np.ceil(-0.5 - shift)
    hi = np.ceil(n - 0.5 - shift)
    for _ in range(2):  # each candidate is within one of the bound
        lo = np.where((lo - 1 + 0.5) + shift >= 0, lo - 1, lo)
        lo = np.where((lo + 0.5) + shift < 0, lo + 1, lo)
        hi = np.where((hi - 1 + 0.5) + shift >= n, hi - 1, hi)
        hi = np.where((hi + 0.5) + shift < n, hi + 1, hi)
    lo = np.clip(lo, 0, n).astype(np.int64)
    hi = np.clip(hi, 0, n).astype(np.int64)
    return lo, np.maximum(hi, lo)


def _fill_u8(fill) -> torch.Tensor:
    return torch.tensor([int(v) for v in fill], dtype=torch.uint8)


def _warp_1d(img, axis, shift, resample, fill) -> torch.Tensor:
    """Pillow's transform of `img` whose source coordinate along `axis` is
    fl(i + 0.5 + shift) (one shift per line of the other axis, or one for all) and is
    the output's along the other axis."""
    _check(resample)
    n = img.shape[axis]
    shift = np.asarray(shift, dtype=np.float64)
    whole = np.floor(shift)
    values = _interpolate_lines(img, axis, shift - whole, resample)
    lo, hi = _valid_range(n, shift)
    # Output i's anchor is i + whole: index i + whole + 1 of `values`.
    if shift.ndim == 0:
        return _shift_all(values, axis, int(whole), int(lo), int(hi), fill)
    return _shift_lines(values, axis, whole.astype(np.int64), lo, hi, fill)


def _shift_all(values, axis, whole, lo, hi, fill) -> torch.Tensor:
    """Every line moved by `whole`: output [lo, hi) from `values`, the rest filled."""
    n = values.shape[axis] - 1
    shape = list(values.shape)
    shape[axis] = n
    out = torch.empty(shape, dtype=torch.uint8)
    colour = _fill_u8(fill)
    if lo > 0:
        out.narrow(axis, 0, lo).copy_(colour.expand(out.narrow(axis, 0, lo).shape))
    if hi < n:
        rest = out.narrow(axis, hi, n - hi)
        rest.copy_(colour.expand(rest.shape))
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


def _shift_lines(values, axis, whole, lo, hi, fill) -> torch.Tensor:
    """Line j moved by `whole[j]`: output i of line j is anchor i + whole[j] of
    `values` for i in [lo[j], hi[j]), the fill colour elsewhere. One gather from a
    buffer where `values` sits between fill margins: an output outside its line's
    range lands in a margin or on one of the two end anchors, which are set to the
    fill colour on the lines whose inside outputs do not use them."""
    n = values.shape[axis] - 1
    buf, margin = _lines_buffer(values.shape, axis, fill)
    inside = buf.narrow(axis, margin, n + 1)
    inside.copy_(values.clamp_(0, 255).to(torch.int16))
    # Anchor -1 serves an inside output only where lo + whole == -1, anchor n - 1 only
    # where hi - 1 + whole == n - 1; elsewhere outputs beyond the range may read them.
    lines = np.arange(len(whole))
    first = lines[(lo + whole != -1)]
    last = lines[(hi - 1 + whole != n - 1)]
    colour = _fill_u8(fill)
    if axis == 1:
        inside[first, 0] = colour
        inside[last, n] = colour
    else:
        inside[0, first] = colour
        inside[n, last] = colour
    whole = np.clip(whole, -(n + 1), n + 1)  # beyond that a line is all fill anyway
    line_len = buf.shape[axis]
    if axis == 1:  # flat index: row j, column margin + 1 + i + whole[j], channel c
        start = (lines * line_len + margin + 1 + whole) * 3
        index = torch.from_numpy(start.astype(np.int32)).view(-1, 1)
        index = index + torch.arange(n * 3, dtype=torch.int32)
    else:  # row margin + 1 + i + whole[j] of column j
        width = buf.shape[1]
        start = (margin + 1 + whole) * width * 3
        per_column = np.repeat(start + lines * 3, 3) + np.tile(np.arange(3), len(lines))
        rows = torch.arange(n, dtype=torch.int32).view(-1, 1) * (width * 3)
        index = rows + torch.from_numpy(per_column.astype(np.int32))
    out = torch.index_select(buf.view(-1), 0, index.view(-1))
    if axis == 1:
        return out.view(len(lines), n, 3)
    return out.view(n, len(lines), 3)


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
    centre, same size), with Pillow's exact shortcuts for 0, 90, 180 and 270."""
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
    f) with x' = x + 0.5, y' = y + 0.5."""
    _check(resample)
    h, w = img.shape[:2]
    a, b, c, d, e, f = (float(v) for v in matrix[:6])
    xc = np.arange(w, dtype=np.float64) + 0.5
    yc = np.arange(h, dtype=np.float64)[:, None] + 0.5
    # Pillow's order: (a x' + b y') + c, one rounding per operation.
    xin = (a * xc + b * yc) + c
    yin = (d * xc + e * yc) + f
    inside = (xin >= 0) & (xin < w) & (yin >= 0) & (yin < h)
    xs, ys = xin - 0.5, yin - 0.5
    if resample == BILINEAR:
        values = _bilinear(img, xs, ys)
    else:
        x0, y0 = np.floor(xs), np.floor(ys)
        values = _bicubic(img, x0, y0, xs - x0, ys - y0)
    if not inside.all():  # per channel: (v - fill) x inside + fill
        keep = torch.from_numpy(inside.reshape(-1).astype(np.float32))
        for c, colour in enumerate(fill):
            values[c].sub_(float(colour)).mul_(keep).add_(float(colour))
    planar = values.view(3, h, w).clamp_(0, 255).to(torch.int16)
    return torch.empty(h, w, 3, dtype=torch.uint8).copy_(planar.permute(1, 2, 0))


def _bilinear(img, xs, ys) -> torch.Tensor:
    """Bilinear values at (xs, ys) (pixel coordinates, centres at integers), edges
    extended, float32 (3, h w): torch's grid sampler with border padding, which clamps
    the coordinates as Pillow clamps the taps (and returns channels first)."""
    h, w = img.shape[:2]
    grid = np.stack(((2 * xs + 1) / w - 1, (2 * ys + 1) / h - 1), axis=-1)
    grid = torch.from_numpy(grid.astype(np.float32))[None]
    src = img.to(torch.float32).permute(2, 0, 1)[None]
    out = F.grid_sample(src, grid, "bilinear", "border", align_corners=False)
    return out.view(3, h * w)


def _packed_source(img: torch.Tensor) -> torch.Tensor:
    """`img` with _PAD edge pixels on every side, each pixel packed into one int32
    (R | G << 8 | B << 16): flat (h + 4) x (w + 4), so that one gather fetches a whole
    pixel."""
    h, w = img.shape[:2]
    hp, wp = h + 2 * _PAD, w + 2 * _PAD
    rgbx = torch.zeros(hp, wp, 4, dtype=torch.uint8)
    rgbx[_PAD:-_PAD, _PAD:-_PAD, :3] = img
    packed = rgbx.view(torch.int32).view(hp, wp)
    packed[_PAD:-_PAD, :_PAD] = packed[_PAD:-_PAD, _PAD : _PAD + 1]
    packed[_PAD:-_PAD, -_PAD:] = packed[_PAD:-_PAD, -_PAD - 1 : -_PAD]
    packed[:_PAD] = packed[_PAD : _PAD + 1]
    packed[-_PAD:] = packed[-_PAD - 1 : -_PAD]
    return packed.view(-1)


def _bicubic(img, x0, y0, dx, dy) -> torch.Tensor:
    """Pillow's bicubic (a = -1) values from the 4 x 4 taps around anchors (x0, y0)
    with fractions (dx, dy), edges extended; float32 (3, h w), one row per channel.
    Anchors of points outside the image are clamped (those pixels are filled
    afterwards). Each tap is one gather of packed pixels, split into its channels, so
    that every product runs along whole contiguous rows of h w values (a per-pixel
    weight on the interleaved (h, w, 3) layout would be broadcast along its innermost
    axis, which torch does not vectorize) and the working set stays small."""
    h, w = img.shape[:2]
    src = _packed_source(img)
    wp = w + 2 * _PAD
    x0 = np.clip(x0, -1, w - 1).reshape(-1)
    y0 = np.clip(y0, -1, h - 1).reshape(-1)
    corner = torch.from_numpy(((y0 + _PAD - 1) * wp + (x0 + _PAD - 1)).astype(np.int32))
    wx = np.stack(kernel_weights(dx.reshape(-1), BICUBIC)).astype(np.float32)
    wy = np.stack(kernel_weights(dy.reshape(-1), BICUBIC)).astype(np.float32)
    wx, wy = torch.from_numpy(wx), torch.from_numpy(wy)
    out = torch.zeros(3, h * w)
    channel = torch.empty(h * w, dtype=torch.int32)
    for j in range(4):
        for i in range(4):
            tap = torch.index_select(src, 0, corner + (j * wp + i))
            weight = torch.mul(wx[i], wy[j])
            for c in range(3):
                torch.bitwise_and(tap, 255, out=channel)
                out[c].addcmul_(channel.to(torch.float32), weight)
                tap.bitwise_right_shift_(8)
    return out
