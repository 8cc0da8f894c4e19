"""Per-image transforms on the host: an encoded image in, a uint8 RGB image of fixed
size written into its row of the batch.

Train: random-resized-crop (or DeiT III's simple random crop, DATA.TRAIN_CROP) +
horizontal flip at TRAIN.IM_SIZE, then the optional DeiT III 3-Augment
(TRAIN.THREE_AUGMENT), colour jitter (TRAIN.COLOR_JITTER) and TRAIN.AUGMENT policy
(timm's AutoAugment / RandAugment / AugMix); augment.py holds the DeiT pieces.
Test: resize the shorter side to TEST.IM_SIZE and center-crop TRAIN.IM_SIZE (pycls).
The train crop is resized by torch's uint8 antialiased bilinear kernel
(`EncodedImage.crop_flip_resize_into`, JPEGs decoded without Pillow's header
parsing); the test crop by Pillow (`resize(box=...)`, exact pycls resize-then-crop at
fractional boxes); both on a reduced-size JPEG decode where that keeps enough pixels.

With TRAIN.AUGMENT_BACKEND tensor (the default) the augmentations run on the crop
where it was resized to, the image's row of the batch buffer, as torch ops
(policies.py, pixel_ops.py, geometry_ops.py: Pillow's pixels, the GIL released), and
draw from the image's own generator: augmented batches are reproducible and the same
in every loader mode. TRAIN.AUGMENT_BACKEND pil keeps the reference: the crop resized
by Pillow, then timm's and torchvision's PIL operations (timm's draws from the global
`random`).
Colour normalization and PCA lighting are not here: they run on the device
(pycls_fast/datasets/to_device/transform.py), so batches stay uint8 on the host.
"""

import math
import random
import re
import threading
from collections.abc import Callable, Sequence

import numpy as np
import torch
from PIL import Image
from yacs.config import CfgNode

from pycls_fast.datasets.images import augment as deit
from pycls_fast.datasets.images import policies
from pycls_fast.datasets.images.decode import EncodedImage, crop_resize, to_rgb
from pycls_fast.errors import ConfigError

BACKENDS = ("tensor", "pil", "device")

# ImageNet mean in 0-255, timm's fill colour for geometric augmentations.
_FILL = (124, 116, 104)


def random_resized_crop_box(
    w: int,
    h: int,
    rng: random.Random,
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
) -> tuple[int, int, int, int]:
    """Returns a random crop box (left, top, right, bottom) of a `w` x `h` image.

    The box covers a uniform fraction in `scale` of the area with a log-uniform aspect
    ratio in `ratio` (torchvision's RandomResizedCrop and pycls's random_sized_crop);
    after 10 failed tries, the largest center crop within `ratio`. `rng` is a
    `random.Random`.
    """
    area = w * h
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    for _ in range(10):
        target = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(log_lo, log_hi))
        cw = round(math.sqrt(target * aspect))
        ch = round(math.sqrt(target / aspect))
        if 0 < cw <= w and 0 < ch <= h:
            x = rng.randint(0, w - cw)
            y = rng.randint(0, h - ch)
            return (x, y, x + cw, y + ch)
    in_ratio = w / h
    if in_ratio < ratio[0]:
        cw, ch = w, round(w / ratio[0])
    elif in_ratio > ratio[1]:
        cw, ch = round(h * ratio[1]), h
    else:
        cw, ch = w, h
    x, y = (w - cw) // 2, (h - ch) // 2
    return (x, y, x + cw, y + ch)


def center_crop_box(
    w: int, h: int, resize_size: int, crop_size: int
) -> tuple[float, float, float, float]:
    """Returns the box that 'resize the shorter side to `resize_size`, then center-crop
    `crop_size`' keeps, in the coordinates of the `w` x `h` original."""
    side = min(w, h) * crop_size / resize_size
    x, y = (w - side) / 2, (h - side) / 2
    return (x, y, x + side, y + side)


def make_augment(
    augment: str, im_size: int, interpolation: str = "random"
) -> Callable[[Image.Image], Image.Image] | None:
    """Returns timm's transform for a TRAIN.AUGMENT string, or None for ''.

    timm's own strings go through timm's factories exactly as timm's
    `transforms_imagenet_train` builds them: 'rand-m9-mstd0.5-inc1' (RandAugment, as
    DeiT), 'augmix-m5-w4-d2' (AugMix), 'original' / 'originalr' / 'v0' / 'v0r'
    (AutoAugment policies). pycls's spellings keep working: 'AutoAugment' (timm
    'original') and 'RandAugment_N2_M0.5[_P1.0]': N ops at magnitude M in [0, 1]
    (timm's scale is 0-10, so M0.5 -> m5), each with probability P. `interpolation`
    ('bicubic', 'bilinear' or 'random'): that of the geometric ops (timm's
    aa_params; 'random' picks one per op, timm's default). Raises ConfigError naming
    TRAIN.AUGMENT on anything else.
    """
    if not augment:
        return None
    from timm.data.auto_augment import (
        augment_and_mix_transform,
        auto_augment_transform,
        rand_augment_transform,
    )
    from timm.data.transforms import str_to_pil_interp

    hparams = {"translate_const": int(im_size * 0.45), "img_mean": _FILL}
    if interpolation != "random":
        hparams["interpolation"] = str_to_pil_interp(interpolation)
    if augment == "AutoAugment":
        augment = "original"
    pycls = re.fullmatch(r"RandAugment((?:_[NMP][0-9.]+)*)", augment)
    if pycls:
        params = {p[0]: float(p[1:]) for p in pycls.group(1).split("_")[1:]}
        if "M" not in params or not 0 <= params["M"] <= 1:
            raise ConfigError(
                f"TRAIN.AUGMENT {augment!r} needs a magnitude M in [0, 1], "
                "e.g. RandAugment_N2_M0.5"
            )
        n, m, p = int(params.get("N", 2)), round(params["M"] * 10), params.get("P", 1.0)
        augment = f"rand-n{n}-m{m}-p{p}"
    try:
        if augment.startswith("rand"):
            transform = rand_augment_transform(augment, hparams)
        elif augment.startswith("augmix"):
            hparams["translate_pct"] = 0.3
            transform = augment_and_mix_transform(augment, hparams)
        else:
            transform = auto_augment_transform(augment, hparams)
    except (AssertionError, ValueError, KeyError, IndexError) as e:
        raise ConfigError(
            f"TRAIN.AUGMENT {augment!r} is not a timm augmentation string "
            "('rand-m9-mstd0.5-inc1', 'augmix-m5-w4-d2', 'original', ...) nor pycls's "
            f"('AutoAugment', 'RandAugment_N2_M0.5'): {e}"
        ) from None
    for op in _timm_ops(transform):
        if op.name.startswith("Posterize"):
            op.aug_fn = posterize_pil
    return transform


def _timm_ops(transform):
    """The AugmentOps of a timm RandAugment, AugMixAugment or AutoAugment."""
    if hasattr(transform, "ops"):
        return list(transform.ops)
    return [op for sub in transform.policy for op in sub]


def posterize_pil(img: Image.Image, bits_to_keep: int, **_) -> Image.Image:
    """timm's posterize as it was before Pillow 13: 0 bits clears every bit (timm's
    'rand-m9-mstd0.5-inc1' asks for 0 bits in ~0.15% of images; Pillow 13's
    ImageOps.posterize raises ValueError for it, and the image was dropped as bad)."""
    from PIL import ImageOps

    if bits_to_keep >= 8:
        return img
    if bits_to_keep <= 0:
        return Image.new(img.mode, img.size, 0)
    return ImageOps.posterize(img, bits_to_keep)


class _IntraOpThreads(threading.local):
    one = False


_intra_op = _IntraOpThreads()


def one_intra_op_thread() -> None:
    """Runs this thread's torch ops on one core (once per thread; not in the main
    thread, whose torch ops are the training's).

    The augmentations' tensors are large enough for torch to split each op over its
    intra-op threads: every decoding thread would then start a team of its own,
    oversubscribing the cores (and a process forked afterwards can hang in OpenMP).
    With torch's OpenMP backend the setting is this thread's own, but torch also keeps
    it as the default of threads that start torch work later; TrainTransform's
    constructor settles the constructing (main) thread's own first.
    """
    if _intra_op.one or threading.current_thread() is threading.main_thread():
        return
    if torch.get_num_threads() > 1:
        torch.set_num_threads(1)
    _intra_op.one = True


class TrainTransform:
    """Random-resized-crop (or DeiT III's simple random crop) + flip (+ 3-Augment,
    colour jitter, AutoAugment / RandAugment / AugMix) to `im_size` x `im_size` RGB;
    `augment_backend` 'tensor' (torch ops on the crop in the batch row), 'pil'
    (the reference: Pillow, timm and torchvision on PIL images) or 'device' (the
    crop and flip only: DeviceBatchTransform applies the rest)."""

    def __init__(
        self,
        im_size: int,
        augment: str = "",
        scale: Sequence[float] = (0.08, 1.0),
        hflip: float = 0.5,
        crop: str = "random_resized",
        three_augment: bool = False,
        color_jitter: float = 0.0,
        augment_interpolation: str = "random",
        augment_backend: str = "tensor",
    ) -> None:
        if augment_backend not in BACKENDS:
            raise ConfigError(
                f"TRAIN.AUGMENT_BACKEND {augment_backend!r}: one of {BACKENDS}"
            )
        self.out_size = (im_size, im_size)
        # 'device': the augmentations run on the batch (to_device/augment_policy.py),
        # the crops as with 'tensor'.
        self.tensor = augment_backend in ("tensor", "device")
        if self.tensor:
            torch.get_num_threads()  # settles this thread's intra-op threads
        if augment_backend == "device":
            augment, three_augment, color_jitter = "", False, 0.0
        self.augment = make_augment(augment, im_size, augment_interpolation)
        if self.tensor and self.augment is not None:
            self.augment = policies.from_timm(self.augment)
        self.scale = tuple(scale)
        self.hflip = hflip
        self.simple_crop = crop == "simple_random"
        self.three_augment = three_augment
        self.color_jitter = color_jitter
        self.direct = not (
            self.augment or self.simple_crop or three_augment or color_jitter
        )

    def __call__(
        self, image: EncodedImage, rng: random.Random, out: np.ndarray
    ) -> None:
        """Writes the transformed `image` into `out`.

        `image`: an EncodedImage (not yet decoded); `rng`: a `random.Random`; `out`:
        writable uint8 (im_size, im_size, 3) array. Every draw comes from `rng`, in the
        order crop, flip, 3-Augment, colour jitter, TRAIN.AUGMENT; with the 'pil'
        backend timm's TRAIN.AUGMENT draws from the global `random` module instead, so
        its results are not reproducible across runs of a multi-threaded loader.
        """
        if self.tensor:
            return self._tensor_path(image, rng, out)
        if self.simple_crop:
            im = deit.simple_random_crop(to_rgb(image.pil()), self.out_size[0], rng)
            flip = rng.random() < self.hflip
        else:
            box = random_resized_crop_box(*image.size, rng, scale=self.scale)
            flip = rng.random() < self.hflip
            if self.direct:
                image.crop_flip_resize_into(box, out, flip)
                return
            im = crop_resize(image.pil(), box, self.out_size)
        if flip:
            im = im.transpose(Image.FLIP_LEFT_RIGHT)
        # DeiT III's order: crop and flip, 3-Augment, colour jitter.
        if self.three_augment:
            im = deit.three_augment(im, rng)
        if self.color_jitter:
            im = deit.color_jitter(im, self.color_jitter, rng)
        if self.augment is not None:
            im = self.augment(im)
        _write(im, out)

    def _tensor_path(self, image, rng, out):
        if self.simple_crop:
            im = deit.simple_random_crop(to_rgb(image.pil()), self.out_size[0], rng)
            flip = rng.random() < self.hflip
            if flip:
                im = im.transpose(Image.FLIP_LEFT_RIGHT)
            _write(im, out)
        else:
            box = random_resized_crop_box(*image.size, rng, scale=self.scale)
            flip = rng.random() < self.hflip
            image.crop_flip_resize_into(box, out, flip)
            if self.direct:
                return
        one_intra_op_thread()
        row = torch.from_numpy(out)
        x = row
        # DeiT III's order: crop and flip, 3-Augment, colour jitter.
        if self.three_augment:
            x = deit.three_augment_tensor(x, rng)
        if self.color_jitter:
            x = deit.color_jitter_tensor(x, self.color_jitter, rng)
        if self.augment is not None:
            x = self.augment(x, rng)
        if x is not row:
            row.copy_(x)


class TestTransform:
    """Resize the shorter side to `resize_size`, center-crop `im_size` (pycls)."""

    def __init__(self, im_size: int, resize_size: int) -> None:
        if resize_size < im_size:  # the crop would leave every image
            raise ConfigError(
                f"TEST.IM_SIZE ({resize_size}) must be at least TRAIN.IM_SIZE "
                f"({im_size}) to evaluate: images are resized to TEST.IM_SIZE, "
                "then center-cropped to TRAIN.IM_SIZE"
            )
        self.out_size = (im_size, im_size)
        self.resize_size = resize_size

    def __call__(
        self, image: EncodedImage, rng: random.Random, out: np.ndarray
    ) -> None:
        """Writes the center crop of `image` (an EncodedImage) into `out`, a writable
        uint8 (im_size, im_size, 3) array; `rng` is unused."""
        box = center_crop_box(*image.size, self.resize_size, self.out_size[0])
        _write(crop_resize(image.pil(), box, self.out_size), out)


def _write(im, out):
    """Copies the RGB PIL image `im` into `out`; a size mismatch is a transform bug,
    not a bad file, so it is not raised as one of the decode errors."""
    arr = np.asarray(im)
    if arr.shape != out.shape:
        raise RuntimeError(f"transform returned {arr.shape}, expected {out.shape}")
    out[...] = arr


def build_transform(
    cfg: CfgNode, train: bool, im_size: int | None = None
) -> "TrainTransform | TestTransform":
    """Returns the train (TRAIN.IM_SIZE, or `im_size`: a TRAIN.SIZE_SCHEDULE stage's;
    TRAIN.AUGMENT) or test (TEST.IM_SIZE, then TRAIN.IM_SIZE) transform of `cfg`."""
    if train:
        return TrainTransform(
            im_size or cfg.TRAIN.IM_SIZE,
            cfg.TRAIN.AUGMENT,
            cfg.DATA.CROP_SCALE,
            cfg.DATA.HFLIP,
            cfg.DATA.TRAIN_CROP,
            cfg.TRAIN.THREE_AUGMENT,
            cfg.TRAIN.COLOR_JITTER,
            cfg.TRAIN.AUGMENT_INTERPOLATION,
            cfg.TRAIN.AUGMENT_BACKEND,
        )
    return TestTransform(cfg.TRAIN.IM_SIZE, cfg.TEST.IM_SIZE)
