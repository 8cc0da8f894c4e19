"""The embedded demo dataset: scikit-learn's handwritten digits as an ImageNet folder.

1,797 real 8x8 scans of the digits 0-9 (shipped inside scikit-learn, nothing is
downloaded), upscaled and written as JPEGs into `<root>/train/<class>/` and
`<root>/val/<class>/` with a fixed, stratified split (80% / 20%), so the whole data path
(folder index, JPEG decoding, transforms) runs as it does on ImageNet.
"""

import os

import numpy as np
from PIL import Image

CLASSES = [f"digit_{d}" for d in range(10)]


def build_digits_folder(
    root: str, size: int = 32, val_frac: float = 0.2, seed: int = 0
) -> dict[str, int]:
    """Writes the digits folder under `root` (skipped if complete); returns
    {"train": n, "val": n} image counts."""
    from sklearn.datasets import load_digits

    marker = os.path.join(root, ".complete")
    digits = load_digits()
    images, labels = digits.images, digits.target
    rng = np.random.default_rng(seed)
    split = np.empty(len(labels), dtype=object)
    for c in range(10):
        members = rng.permutation(np.flatnonzero(labels == c))
        n_val = int(round(len(members) * val_frac))
        split[members[:n_val]], split[members[n_val:]] = "val", "train"
    counts = {
        "train": int((split == "train").sum()),
        "val": int((split == "val").sum()),
    }
    if os.path.exists(marker):
        return counts
    for i, (pixels, label) in enumerate(zip(images, labels)):
        folder = os.path.join(root, split[i], CLASSES[label])
        os.makedirs(folder, exist_ok=True)
        # 0..16 ink levels -> white digits on black, as 8-bit grey, then upscaled.
        grey = (pixels * (255.0 / 16.0)).round().astype(np.uint8)
        im = Image.fromarray(grey, mode="L").resize((size, size), Image.BICUBIC)
        im.save(os.path.join(folder, f"{i:04d}.jpg"), quality=95)
    with open(marker, "w") as f:
        f.write(f"{counts}\n")
    return counts
