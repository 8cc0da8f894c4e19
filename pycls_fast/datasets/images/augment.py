"""DeiT / DeiT III host-side augmentations, driven by the per-image `random.Random`.

- `simple_random_crop`: DeiT III's SRC: resize the shorter side to the output size
  (bicubic), pad 4 pixels by reflection, take a random crop (torchvision's
  `Resize(size, BICUBIC)` + `RandomCrop(size, padding=4, padding_mode="reflect")`).
- `three_augment`: DeiT III's 3-Augment: one of grayscale, solarization (threshold
  128) and Gaussian blur (radius uniform in [0.1, 2]), chosen uniformly per image.
- `color_jitter`: torchvision's `ColorJitter(b, c, s)` (no hue): brightness, contrast
  and saturation factors uniform in [max(0, 1 - x), 1 + x], applied in a random order.

3-Augment and colour jitter come twice: on uint8 (H, W, 3) tensors
(`three_augment_tensor`, `color_jitter_tensor`: pixel_ops, the same pixels as
Pillow's without holding the GIL; TRAIN.AUGMENT_BACKEND tensor) and as torchvision's
and Pillow's own functions on PIL images (TRAIN.AUGMENT_BACKEND pil). Only the random
draws are made here, the same ones for both, from the image's own generator, so that
augmented batches do not depend on the thread that decodes an image, and resume and
rank independence stay exact (the torchvision transforms draw from torch's global
generator).
"""

import random

import numpy as np
import torch
from PIL import Image, ImageFilter, ImageOps

from pycls_fast.datasets.images import pixel_ops

BLUR_RADIUS = (0.1, 2.0)  # DeiT III's GaussianBlur(radius_min, radius_max)
SOLARIZE_THRESHOLD = 128  # PIL's default, as DeiT III's Solarization uses
SRC_PADDING = 4


def simple_random_crop(im: Image.Image, size: int, rng: random.Random) -> Image.Image:
    """Shorter side to `size` (bicubic), reflect-pad 4, random `size` x `size` crop."""
    w, h = im.size
    # torchvision's Resize(int): the shorter side becomes `size`, the longer one is
    # truncated, not rounded.
    new = (size, int(size * h / w)) if w <= h else (int(size * w / h), size)
    arr = np.asarray(im.resize(new, Image.BICUBIC))
    pad = SRC_PADDING
    arr = np.pad(arr, ((pad, pad), (pad, pad), (0, 0)), mode="reflect")
    top = rng.randint(0, arr.shape[0] - size)
    left = rng.randint(0, arr.shape[1] - size)
    return Image.fromarray(arr[top : top + size, left : left + size])


def three_augment(im: Image.Image, rng: random.Random) -> Image.Image:
    """One of grayscale (3 channels), solarize, Gaussian blur, uniformly."""
    choice = rng.randrange(3)
    if choice == 0:
        gray = im.convert("L")
        return Image.merge("RGB", (gray, gray, gray))
    if choice == 1:
        return ImageOps.solarize(im, SOLARIZE_THRESHOLD)
    radius = rng.uniform(*BLUR_RADIUS)
    return im.filter(ImageFilter.GaussianBlur(radius=radius))


def three_augment_tensor(img: torch.Tensor, rng: random.Random) -> torch.Tensor:
    """`three_augment` on a uint8 (H, W, 3) tensor: the same draws, the same pixels."""
    choice = rng.randrange(3)
    if choice == 0:
        return pixel_ops.grayscale(img)
    if choice == 1:
        return pixel_ops.solarize(img, SOLARIZE_THRESHOLD)
    return pixel_ops.gaussian_blur(img, rng.uniform(*BLUR_RADIUS))


def jitter_params(strength: float, rng: random.Random) -> tuple[list[int], list[float]]:
    """(order of the three operations, their factors) for ColorJitter(strength x 3)."""
    lo, hi = max(0.0, 1.0 - strength), 1.0 + strength
    factors = [rng.uniform(lo, hi) for _ in range(3)]
    order = [0, 1, 2]
    rng.shuffle(order)
    return order, factors


def color_jitter(im: Image.Image, strength: float, rng: random.Random) -> Image.Image:
    """Brightness, contrast and saturation each by a factor uniform in
    [max(0, 1 - strength), 1 + strength], in a random order (torchvision's
    functions)."""
    import torchvision.transforms.functional as F

    ops = (F.adjust_brightness, F.adjust_contrast, F.adjust_saturation)
    order, factors = jitter_params(strength, rng)
    for k in order:
        im = ops[k](im, factors[k])
    return im


def color_jitter_tensor(
    img: torch.Tensor, strength: float, rng: random.Random
) -> torch.Tensor:
    """`color_jitter` on a uint8 (H, W, 3) tensor: the same draws, the same pixels
    (torchvision's PIL functions are ImageEnhance's Brightness, Contrast, Color)."""
    ops = (pixel_ops.brightness, pixel_ops.contrast, pixel_ops.color)
    order, factors = jitter_params(strength, rng)
    for k in order:
        img = ops[k](img, factors[k])
    return img
