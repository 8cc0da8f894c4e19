"""Photo-like JPEG folders in the ImageNet layout, for tests, demos and benchmarks.

The images are random crops of the two photos that scikit-learn ships
(`sklearn.datasets.load_sample_images`), recoloured and resized, so that they compress
and decode like real photos (flat noise or gradients would not). Nothing is downloaded.
"""

import os
from collections.abc import Sequence

import numpy as np
from PIL import Image

# ImageNet-1k's train images are mostly 500 pixels on the long side at 4:3 (500x375,
# 375x500) or 3:2, with smaller images and a few large ones (mean about 400x350).
# `imagenet_like_size` draws from this mixture (shares of images; landscape 3 of 4):
# long side 500 at 4:3 or 3:2, long side uniform in [100, 500) at 4:3, 3:2, 1:1 or
# 16:9, long side uniform in [600, 1600] at 4:3 or 3:2. Its mean is about 420x360.
_SIZE_MIXTURE = (
    (0.50, (500, 500), (4 / 3,)),
    (0.08, (500, 500), (3 / 2,)),
    (0.38, (100, 500), (4 / 3, 3 / 2, 1.0, 16 / 9)),
    (0.04, (600, 1600), (4 / 3, 3 / 2)),
)
_LANDSCAPE = 0.75


def _source_photos():
    """Returns the sample photos as a list of HWC uint8 RGB arrays."""
    from sklearn.datasets import load_sample_images

    return list(load_sample_images().images)


def make_image(
    rng: np.random.Generator, photos: Sequence[np.ndarray], size: tuple[int, int]
) -> Image.Image:
    """Returns one photo-like PIL RGB image of `size` = (width, height).

    A random crop (40-100% of the source side) of a random source photo, optionally
    flipped, with its channels permuted and scaled, resized to `size`.
    """
    photo = photos[rng.integers(len(photos))]
    h, w = photo.shape[:2]
    frac = rng.uniform(0.4, 1.0)
    ch, cw = max(8, int(h * frac)), max(8, int(w * frac))
    y, x = rng.integers(0, h - ch + 1), rng.integers(0, w - cw + 1)
    crop = photo[y : y + ch, x : x + cw]
    if rng.random() < 0.5:
        crop = crop[:, ::-1]
    # Recolour so that images of different classes differ in colour statistics.
    gains = rng.uniform(0.7, 1.2, size=3)
    crop = np.clip(crop[:, :, rng.permutation(3)] * gains, 0, 255).astype(np.uint8)
    return Image.fromarray(np.ascontiguousarray(crop)).resize(size, Image.BILINEAR)


def imagenet_like_size(rng: np.random.Generator) -> tuple[int, int]:
    """A (width, height) drawn from `_SIZE_MIXTURE`, ImageNet-1k's train sizes."""
    weights = [share for share, _, _ in _SIZE_MIXTURE]
    _, (low, high), aspects = _SIZE_MIXTURE[rng.choice(len(weights), p=weights)]
    long_side = int(rng.integers(low, high + 1)) if high > low else low
    short_side = max(1, round(long_side / aspects[rng.integers(len(aspects))]))
    if rng.random() < _LANDSCAPE:
        return long_side, short_side
    return short_side, long_side


def make_image_folder(
    root: str,
    splits: Sequence[str] = ("train", "val"),
    num_classes: int = 4,
    images_per_class: int = 8,
    size: tuple[int, int] | str = (500, 375),
    quality: int = 95,
    seed: int = 0,
) -> str:
    """Writes `root/<split>/<class>/<image>.JPEG` and returns `root`.

    Classes are named like WordNet ids (`n00000000`, `n00000001`, ...). `size` is the
    (width, height) of the images, 500x375 by default (ImageNet's most common size;
    at quality 95 such a file is about 20-100 KB, median 60 KB), or "imagenet": each
    image's own size drawn by `imagenet_like_size`. Deterministic for a given `seed`.
    """
    rng = np.random.default_rng(seed)
    photos = _source_photos()
    for split in splits:
        for c in range(num_classes):
            folder = os.path.join(root, split, f"n{c:08d}")
            os.makedirs(folder, exist_ok=True)
            for i in range(images_per_class):
                shape = imagenet_like_size(rng) if size == "imagenet" else size
                im = make_image(rng, photos, shape)
                path = os.path.join(folder, f"{split}_{c:04d}_{i:06d}.JPEG")
                im.save(path, quality=quality)
    return root
