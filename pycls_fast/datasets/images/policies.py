"""timm's AutoAugment, RandAugment and AugMix on uint8 (H, W, 3) RGB tensors.

`from_timm` turns the transform timm builds for a TRAIN.AUGMENT string (its ops, their
probabilities, magnitudes, magnitude noise, hparams and interpolation; AutoAugment's
sub-policies; RandAugment's layer count and choice weights; AugMix's width, depth and
alpha) into the same policy over the tensor operations of pixel_ops and
geometry_ops, which give Pillow's pixels without holding the GIL.

The draws are timm's, in timm's order (op choice, then per op: whether it applies, its
magnitude, its sign, its interpolation), from the image's own `random.Random` instead
of the global `random` and `numpy.random`, so a batch depends only on its seed: not on
the thread or process that decodes an image, nor on the loader mode.
"""

import math
import random
from collections.abc import Sequence

import numpy as np
import torch

from pycls_fast.datasets.images import geometry_ops as geometry
from pycls_fast.datasets.images import pixel_ops as pixels

_LEVEL_DENOM = 10.0  # timm's magnitude scale: level / 10 is the op's fraction
_FILL = (128, 128, 128)  # timm's fill when hparams carry no img_mean


def _negate(value: float, rng: random.Random) -> float:
    """timm's _randomly_negate: -value with probability 1/2."""
    return -value if rng.random() > 0.5 else value


# timm's level -> op argument mappings (auto_augment.py), with the sign drawn from rng.
def _rotate_level(level, hparams, rng):
    return (_negate(level / _LEVEL_DENOM * 30.0, rng),)


def _enhance_level(level, hparams, rng):
    return (level / _LEVEL_DENOM * 1.8 + 0.1,)


def _enhance_increasing_level(level, hparams, rng):
    return (max(0.1, 1.0 + _negate(level / _LEVEL_DENOM * 0.9, rng)),)


def _minmax_level(low, high):
    def level_fn(level, hparams, rng):
        return (max(low, min(high, low + (high - low) * (level / _LEVEL_DENOM))),)

    return level_fn


def _shear_level(level, hparams, rng):
    return (_negate(level / _LEVEL_DENOM * 0.3, rng),)


def _translate_abs_level(level, hparams, rng):
    return (_negate(level / _LEVEL_DENOM * float(hparams["translate_const"]), rng),)


def _translate_rel_level(level, hparams, rng):
    return (_negate(level / _LEVEL_DENOM * hparams.get("translate_pct", 0.45), rng),)


def _posterize_level(level, hparams, rng):
    return (int(level / _LEVEL_DENOM * 4),)


def _posterize_increasing_level(level, hparams, rng):
    return (4 - _posterize_level(level, hparams, rng)[0],)


def _posterize_original_level(level, hparams, rng):
    return (int(level / _LEVEL_DENOM * 4) + 4,)


def _solarize_level(level, hparams, rng):
    return (min(256, int(level / _LEVEL_DENOM * 256)),)


def _solarize_increasing_level(level, hparams, rng):
    return (256 - _solarize_level(level, hparams, rng)[0],)


def _solarize_add_level(level, hparams, rng):
    return (min(128, int(level / _LEVEL_DENOM * 110)),)


# The ops: (img, *level args, resample, fill, rng) -> img.
def _no_args(fn):
    return lambda img, resample, fill, rng: fn(img)


def _point(fn):
    return lambda img, value, resample, fill, rng: fn(img, value)


def _interpolation(resample, rng: random.Random) -> int:
    """timm's _interpolation: one of several interpolations drawn per call; a single
    one is used as is (no draw)."""
    return rng.choice(resample) if isinstance(resample, tuple) else resample


def _translate_rel(axis):
    def op(img, pct, resample, fill, rng):
        size = img.shape[1] if axis == 1 else img.shape[0]  # timm: pct x width/height
        shift = geometry.translate_x if axis == 1 else geometry.translate_y
        return shift(img, pct * size, _interpolation(resample, rng), fill)

    return op


def _geometric(name):
    # Looked up per call: the tests put Pillow's own warps in their place to check
    # the draws exactly.
    return lambda img, value, resample, fill, rng: getattr(geometry, name)(
        img, value, _interpolation(resample, rng), fill
    )


def _desaturate(img, factor, resample, fill, rng):
    return pixels.color(img, min(1.0, max(0.0, 1.0 - factor)))


def _gaussian_blur_rand(img, factor, resample, fill, rng):
    return pixels.gaussian_blur(img, rng.uniform(0.1, 2.0 * factor))


# name -> (level function or None, op): timm's LEVEL_TO_ARG and NAME_TO_OP.
OPS = {
    "AutoContrast": (None, _no_args(pixels.autocontrast)),
    "Equalize": (None, _no_args(pixels.equalize)),
    "Invert": (None, _no_args(pixels.invert)),
    "Rotate": (_rotate_level, _geometric("rotate")),
    "Posterize": (_posterize_level, _point(pixels.posterize)),
    "PosterizeIncreasing": (_posterize_increasing_level, _point(pixels.posterize)),
    "PosterizeOriginal": (_posterize_original_level, _point(pixels.posterize)),
    "Solarize": (_solarize_level, _point(pixels.solarize)),
    "SolarizeIncreasing": (_solarize_increasing_level, _point(pixels.solarize)),
    "SolarizeAdd": (_solarize_add_level, _point(pixels.solarize_add)),
    "Color": (_enhance_level, _point(pixels.color)),
    "ColorIncreasing": (_enhance_increasing_level, _point(pixels.color)),
    "Contrast": (_enhance_level, _point(pixels.contrast)),
    "ContrastIncreasing": (_enhance_increasing_level, _point(pixels.contrast)),
    "Brightness": (_enhance_level, _point(pixels.brightness)),
    "BrightnessIncreasing": (_enhance_increasing_level, _point(pixels.brightness)),
    "Sharpness": (_enhance_level, _point(pixels.sharpness)),
    "SharpnessIncreasing": (_enhance_increasing_level, _point(pixels.sharpness)),
    "ShearX": (_shear_level, _geometric("shear_x")),
    "ShearY": (_shear_level, _geometric("shear_y")),
    "TranslateX": (_translate_abs_level, _geometric("translate_x")),
    "TranslateY": (_translate_abs_level, _geometric("translate_y")),
    "TranslateXRel": (_translate_rel_level, _translate_rel(1)),
    "TranslateYRel": (_translate_rel_level, _translate_rel(0)),
    "Desaturate": (_minmax_level(0.5, 1.0), _desaturate),
    "GaussianBlur": (_minmax_level(0.1, 2.0), _point(pixels.gaussian_blur)),
    "GaussianBlurRand": (_minmax_level(0.0, 1.0), _gaussian_blur_rand),
}


class TensorOp:
    """One of timm's AugmentOps on tensors: applied with probability `prob`, at a
    magnitude drawn around `magnitude` (normal with std `magnitude_std`, uniform in
    [0, magnitude] when it is inf), clipped to [0, `magnitude_max` or 10]."""

    def __init__(
        self,
        name: str,
        prob: float,
        magnitude: float,
        magnitude_std: float = 0.0,
        magnitude_max: float | None = None,
        hparams: dict | None = None,
        resample: int | Sequence[int] = (geometry.BILINEAR, geometry.BICUBIC),
        fill: Sequence[int] = _FILL,
    ) -> None:
        if name not in OPS:
            raise ValueError(f"no tensor version of timm's op {name!r}")
        self.name = name
        self.prob = prob
        self.magnitude = magnitude
        self.magnitude_std = magnitude_std
        self.magnitude_max = magnitude_max
        self.hparams = dict(hparams or {})
        # A tuple: one drawn per call; an int: always that one (timm's kwargs).
        if isinstance(resample, (list, tuple)):
            self.resample = tuple(int(r) for r in resample)
        else:
            self.resample = int(resample)
        self.fill = tuple(int(v) for v in fill)

    def draw(self, rng: random.Random) -> tuple | None:
        """The op's arguments for one image (timm's draws: whether it applies, its
        magnitude, its level's sign), or None when it is skipped. Geometric ops draw
        their interpolation afterwards (`draw_resample`)."""
        if self.prob < 1.0 and rng.random() > self.prob:
            return None
        magnitude = self.magnitude
        if self.magnitude_std > 0:
            if math.isinf(self.magnitude_std):
                magnitude = rng.uniform(0, magnitude)
            else:
                magnitude = rng.gauss(magnitude, self.magnitude_std)
        magnitude = max(0.0, min(magnitude, self.magnitude_max or _LEVEL_DENOM))
        level_fn = OPS[self.name][0]
        return level_fn(magnitude, self.hparams, rng) if level_fn else ()

    def draw_resample(self, rng: random.Random) -> int:
        """The interpolation of one call of a geometric op (timm's _interpolation)."""
        return _interpolation(self.resample, rng)

    def __call__(self, img: torch.Tensor, rng: random.Random) -> torch.Tensor:
        """`img` (uint8 (H, W, 3)) transformed, or `img` itself when the op is
        skipped."""
        args = self.draw(rng)
        if args is None:
            return img
        return OPS[self.name][1](img, *args, self.resample, self.fill, rng)

    def __repr__(self) -> str:
        return (
            f"TensorOp({self.name}, p={self.prob}, m={self.magnitude}, "
            f"mstd={self.magnitude_std})"
        )


class RandAugment:
    """`num_layers` ops drawn from `ops` (with replacement, or without and by
    `choice_weights`), applied in turn."""

    def __init__(
        self,
        ops: list[TensorOp],
        num_layers: int = 2,
        choice_weights: Sequence[float] | None = None,
    ) -> None:
        self.ops = ops
        self.num_layers = num_layers
        self.choice_weights = None if choice_weights is None else list(choice_weights)

    def choose(self, rng: random.Random) -> list[TensorOp]:
        """The ops of one image, drawn before any is applied (as timm does)."""
        if self.choice_weights is None:
            return [rng.choice(self.ops) for _ in range(self.num_layers)]
        left = list(range(len(self.ops)))
        weights = list(self.choice_weights)
        chosen = []
        for _ in range(min(self.num_layers, len(left))):
            k = _weighted_index(weights, rng)
            chosen.append(self.ops[left.pop(k)])
            weights.pop(k)
        return chosen

    def __call__(self, img: torch.Tensor, rng: random.Random) -> torch.Tensor:
        for op in self.choose(rng):
            img = op(img, rng)
        return img


def _weighted_index(weights: Sequence[float], rng: random.Random) -> int:
    """An index drawn with probability proportional to `weights`."""
    r = rng.random() * sum(weights)
    for k, w in enumerate(weights):
        r -= w
        if r < 0:
            return k
    return len(weights) - 1


class AutoAugment:
    """One sub-policy (a list of ops) drawn uniformly, its ops applied in turn."""

    def __init__(self, policy: list[list[TensorOp]]) -> None:
        self.policy = policy

    def __call__(self, img: torch.Tensor, rng: random.Random) -> torch.Tensor:
        for op in rng.choice(self.policy):
            img = op(img, rng)
        return img


class AugMix:
    """timm's AugMixAugment: `width` chains of `depth` ops (1 to 3 when depth <= 0)
    on the image, mixed with Dirichlet(alpha) weights, then blended with the image by
    a Beta(alpha, alpha) factor; or, `blended`, each chain blended in turn. timm's
    float32 arithmetic: products and sums in float32, the mix clipped and truncated
    to uint8 before the final blend."""

    def __init__(
        self,
        ops: list[TensorOp],
        alpha: float = 1.0,
        width: int = 3,
        depth: int = -1,
        blended: bool = False,
    ) -> None:
        self.ops = ops
        self.alpha = alpha
        self.width = width
        self.depth = depth
        self.blended = blended

    def draw_mix(self, rng: random.Random) -> tuple[np.ndarray, np.float32]:
        """(Dirichlet(alpha) mixing weights, Beta(alpha, alpha) factor) as float32."""
        gammas = np.array(
            [rng.gammavariate(self.alpha, 1.0) for _ in range(self.width)]
        )
        weights = np.float32(gammas / gammas.sum())
        return weights, np.float32(rng.betavariate(self.alpha, self.alpha))

    def _chain(self, img, rng):
        depth = self.depth if self.depth > 0 else rng.randint(1, 3)
        ops = [rng.choice(self.ops) for _ in range(depth)]
        for op in ops:
            img = op(img, rng)
        return img

    def __call__(self, img: torch.Tensor, rng: random.Random) -> torch.Tensor:
        weights, factor = self.draw_mix(rng)
        if self.blended:
            out = img
            for w in blended_weights(weights, factor):
                out = pixels.blend(out.to(torch.float32), self._chain(img, rng), w)
            return out
        mixed = torch.zeros(img.shape, dtype=torch.float32)
        for w in weights:
            mixed.add_(self._chain(img, rng).to(torch.float32).mul_(float(w)))
        mixed = pixels.to_uint8(mixed)
        return pixels.blend(img.to(torch.float32), mixed, float(factor))


def blended_weights(weights: np.ndarray, factor: np.float32) -> np.ndarray:
    """timm's AugMixAugment._calc_blended_weights: each chain's blend factor when the
    chains are blended in turn (numpy float32, as timm computes them)."""
    weights = weights * factor
    cump = 1.0
    out = []
    for w in weights[::-1]:
        alpha = w / cump
        cump *= 1 - alpha
        out.append(alpha)
    return np.array(out[::-1], dtype=np.float32)


def _from_timm_op(op) -> TensorOp:
    resample = op.kwargs.get("resample", (geometry.BILINEAR, geometry.BICUBIC))
    return TensorOp(
        op.name,
        op.prob,
        op.magnitude,
        op.magnitude_std,
        op.magnitude_max,
        op.hparams,
        resample,
        op.kwargs.get("fillcolor", _FILL),
    )


def from_timm(transform):
    """The tensor policy of timm's RandAugment, AutoAugment or AugMixAugment
    `transform`: the same ops, parameters and structure."""
    from timm.data.auto_augment import AugMixAugment
    from timm.data.auto_augment import AutoAugment as TimmAutoAugment
    from timm.data.auto_augment import RandAugment as TimmRandAugment

    if isinstance(transform, TimmRandAugment):
        weights = transform.choice_weights
        return RandAugment(
            [_from_timm_op(op) for op in transform.ops],
            transform.num_layers,
            None if weights is None else [float(w) for w in weights],
        )
    if isinstance(transform, TimmAutoAugment):
        return AutoAugment(
            [[_from_timm_op(op) for op in sub] for sub in transform.policy]
        )
    if isinstance(transform, AugMixAugment):
        return AugMix(
            [_from_timm_op(op) for op in transform.ops],
            transform.alpha,
            transform.width,
            transform.depth,
            transform.blended,
        )
    raise TypeError(f"not a timm augmentation policy: {type(transform).__name__}")
