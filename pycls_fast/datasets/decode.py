"""Image decoding with Pillow: reduced-size JPEG decoding, RGB conversion, bad files.

Pillow releases the GIL while it decodes and resizes, so several loader threads decode
in parallel. The train crop is resized by torch's uint8 antialiased bilinear kernel
(crop_flip_resize), about 4x faster than Pillow's on one core; it too runs without the
GIL. For JPEGs, `Image.draft` makes libjpeg scale by 1/2, 1/4 or 1/8 during the
inverse DCT, which skips most of the decoding work when the output is much smaller than
the file. (spdl's own decoders, `spdl.io`, need FFmpeg shared libraries that a plain pip
install does not bring, so they are not used here.)
"""

import io
import math
import warnings

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, UnidentifiedImageError

# Pillow hands out read-only arrays; torch warns (once) when wrapping one, although
# crop_flip_resize only reads it.
warnings.filterwarnings("ignore", message="The given NumPy array is not writable")

# What Pillow raises for corrupt, truncated or unsupported files. DecompressionBombError
# (a decompression-bomb guard) subclasses Exception, not OSError: Pillow raises it from
# the header alone, before decoding, for more than 2 x Image.MAX_IMAGE_PIXELS (179 Mpx),
# so such a file is a bad image; below that Pillow only warns, and large JPEGs decode at
# reduced scale (draft_for), in little memory.
DECODE_ERRORS = (
    OSError,
    ValueError,
    SyntaxError,
    UnidentifiedImageError,
    Image.DecompressionBombError,
)


def open_image(path):
    """Reads the file at `path` and opens it lazily (parses the header only, decodes on
    first use); returns a PIL Image.

    One read of the whole file (the GIL is released during it) then parsing from
    memory costs less Python per image than Pillow's many small reads from the file.
    """
    with open(path, "rb") as f:
        data = f.read()
    return Image.open(io.BytesIO(data))


def draft_for(im, box, out_size):
    """Lets a JPEG decode at 1/2, 1/4 or 1/8 scale when the crop stays >= `out_size`.

    `box` = (left, top, right, bottom) in the full-size image; returns the box in the
    coordinates of the (possibly reduced) image that decoding will produce.
    """
    if im.format != "JPEG":
        return box
    w, h = im.size
    crop_w, crop_h = box[2] - box[0], box[3] - box[1]
    # Pillow picks the largest scale that keeps the decoded size >= the requested size,
    # so requesting full_size * out/crop keeps the crop >= out_size pixels wide.
    want = (
        math.ceil(w * out_size[0] / max(crop_w, 1e-6)),
        math.ceil(h * out_size[1] / max(crop_h, 1e-6)),
    )
    if want[0] * 2 > w or want[1] * 2 > h:
        return box  # No reduction possible; skip draft's bookkeeping.
    im.draft("RGB", want)
    sx, sy = im.size[0] / w, im.size[1] / h
    return (box[0] * sx, box[1] * sy, box[2] * sx, box[3] * sy)


def to_rgb(im):
    """Returns `im` as RGB: grayscale, palette, CMYK and alpha images are converted
    (alpha is dropped, as OpenCV's imread does for pycls)."""
    if im.mode == "RGB":
        return im
    if im.mode == "P" and "transparency" in im.info:
        im = im.convert("RGBA")  # Avoids Pillow's warning on palette transparency.
    if im.mode in ("I;16", "I;16B", "I;16L", "I"):
        # 16-bit grayscale PNG: keep the top 8 bits, not a clipped copy of the low ones.
        im = im.point(lambda v: v / 256).convert("L")
    return im.convert("RGB")


def crop_resize(im, box, out_size):
    """Decodes `im`, crops `box` and resizes it to `out_size` = (w, h) in one call.

    Uses a JPEG draft when it keeps enough pixels; returns an RGB PIL Image.
    """
    box = draft_for(im, box, out_size)
    im = to_rgb(im)
    return im.resize(out_size, Image.BILINEAR, box=box)


def crop_flip_resize(im, box, out_size, flip=False):
    """Decodes `im`, crops `box`, optionally mirrors it and resizes it to `out_size`.

    `box` = (left, top, right, bottom) in full-size pixels, rounded to whole pixels of
    the decoded (possibly JPEG-draft reduced) image; `out_size` = (w, h). Returns a
    C-contiguous uint8 (h, w, 3) RGB array. The resize is torch's antialiased bilinear
    (Pillow's BILINEAR filter, vectorized for uint8 and channels-last; one thread for
    any input size, so it does not oversubscribe the cores under loader threads). It
    filters within the crop, where Pillow's `resize(box=...)` also reads the pixels
    just outside it: only the outermost output pixels differ.
    """
    box = draft_for(im, box, out_size)
    im = to_rgb(im)
    w, h = im.size
    left, top = min(round(box[0]), w - 1), min(round(box[1]), h - 1)
    right, bottom = max(round(box[2]), left + 1), max(round(box[3]), top + 1)
    im = im.crop((max(left, 0), max(top, 0), min(right, w), min(bottom, h)))
    if flip:
        im = im.transpose(Image.FLIP_LEFT_RIGHT)  # Mirroring commutes with the resize.
    # (1, h, w, 3) permuted to NCHW is channels-last, the layout of the fast kernel,
    # and the output keeps it, so [0].permute(1, 2, 0) is a contiguous (h, w, 3).
    x = torch.from_numpy(np.asarray(im))[None].permute(0, 3, 1, 2)
    out = F.interpolate(
        x, size=(out_size[1], out_size[0]), mode="bilinear", antialias=True
    )
    return out[0].permute(1, 2, 0).numpy()
