"""Pillow's own C operations on uint8 (H, W, 3) tensors, through this thread's RGBX
buffers: a tensor's pixels copied into a PIL image that shares a torch tensor's
memory, Pillow's operation (its C loop runs without the GIL), and the result copied
back by torch.

For the operations where torch ops cost more than Pillow's C loop (per-pixel
gathers of rotations, the box passes of a Gaussian blur: docs/PERFORMANCE.md,
"Augmentation cost per recipe"); the pixels are Pillow's exactly.
"""

import threading

import numpy as np
import torch
from PIL import Image


class _Buffers(threading.local):
    def __init__(self):
        self.pairs = {}


_buffers = _Buffers()


def rgbx_images(h: int, w: int) -> list[tuple[torch.Tensor, Image.Image]]:
    """This thread's two (uint8 (h, w, 4) tensor, RGBX PIL image over its memory)
    pairs: a source and a destination."""
    pair = _buffers.pairs.get((h, w))
    if pair is None:
        pair = []
        for _ in range(2):
            pixels = np.empty((h, w, 4), dtype=np.uint8)
            image = Image.frombuffer("RGBX", (w, h), pixels, "raw", "RGBX", 0, 1)
            pair.append((torch.from_numpy(pixels), image))
        _buffers.pairs[(h, w)] = pair
    return pair


def packed(colour) -> int:
    """The RGBX pixel of an RGB `colour` as one int32."""
    r, g, b = (int(v) for v in colour)
    return int(np.array([r, g, b, 255], dtype=np.uint8).view(np.int32)[0])


def transform_into(dst: Image.Image, src: Image.Image, matrix, resample: int) -> None:
    """Pillow's affine transform of `src` into `dst` (same mode and size), leaving
    the pixels whose source point lies outside as they are."""
    box = (0, 0, *dst.size)
    dst.im.transform(box, src.im, Image.Transform.AFFINE, matrix, resample, 0)


def gaussian_blur_into(dst: Image.Image, src: Image.Image, radius: float) -> None:
    """ImageFilter.GaussianBlur(radius) of `src` pasted into `dst` (Pillow's three
    box passes per axis, then its paste: both C loops release the GIL)."""
    blurred = src.im.gaussian_blur((radius, radius), 3)
    dst.im.paste(blurred, (0, 0, *dst.size))


def rgb_from(rgbx: torch.Tensor) -> torch.Tensor:
    """A new uint8 (h, w, 3) tensor of the RGB channels of `rgbx`."""
    h, w = rgbx.shape[:2]
    return torch.empty(h, w, 3, dtype=torch.uint8).copy_(rgbx[..., :3])
