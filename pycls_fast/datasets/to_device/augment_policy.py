"""The host's augmentations on the device (TRAIN.AUGMENT_BACKEND device): DeiT III's
3-Augment and colour jitter and TRAIN.AUGMENT's RandAugment / AutoAugment over the
uint8 batch once it is copied, before normalization.

The decoding threads then only crop, resize and flip, the crop + flip path's CPU per
image, whatever the recipe. Here the draws are made per image on the host, in the
host's order (3-Augment, colour jitter, then the policy in timm's order:
images/augment.py, images/policies.py), from a `random.Random` the caller seeds;
then each layer runs each drawn op once over the images that drew it (batch_ops.py:
Pillow's pixels, no value read back from the device). The draws are a few
microseconds of Python per image in the training thread; the pixels are the
device's work.

AugMix (chains of ops blended per image) has no batched form: it is refused when the
policy is built, in one line naming TRAIN.AUGMENT_BACKEND.
"""

import random
from collections import defaultdict

import torch

from pycls_fast.datasets.images import augment as deit
from pycls_fast.datasets.images import geometry_ops, policies
from pycls_fast.datasets.images.transforms import make_augment
from pycls_fast.datasets.to_device import batch_ops
from pycls_fast.errors import ConfigError

# timm's ops with a batched form, by how their draws become batch_ops' parameters.
_AFFINE = {"ShearX", "ShearY", "TranslateX", "TranslateY", "TranslateXRel"}
_AFFINE |= {"TranslateYRel"}
_GEOMETRIC = _AFFINE | {"Rotate"}
_BLENDS = {
    "Color": batch_ops.color,
    "ColorIncreasing": batch_ops.color,
    "Desaturate": batch_ops.color,
    "Contrast": batch_ops.contrast,
    "ContrastIncreasing": batch_ops.contrast,
    "Brightness": batch_ops.brightness,
    "BrightnessIncreasing": batch_ops.brightness,
    "Sharpness": batch_ops.sharpness,
    "SharpnessIncreasing": batch_ops.sharpness,
}
_PLAIN = {
    "AutoContrast": batch_ops.autocontrast,
    "Equalize": batch_ops.equalize,
    "Invert": batch_ops.invert,
    "Grayscale": batch_ops.grayscale,  # DeiT III's
}
_POINT = {"Posterize", "PosterizeIncreasing", "PosterizeOriginal"}
_POINT |= {"Solarize", "SolarizeIncreasing", "SolarizeAdd"}
_BLURS = {"GaussianBlur", "GaussianBlurRand"}
SUPPORTED = _GEOMETRIC | set(_BLENDS) | set(_PLAIN) | _POINT | _BLURS
SUPPORTED -= {"Grayscale"}  # timm's ops: grayscale is 3-Augment's only
# colour jitter's three operations, in jitter_params' numbering
_JITTER = ("Brightness", "Contrast", "Color")


def _to(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list as a tensor on `device` (pinned and asynchronous on CUDA:
    no wait for the device)."""
    t = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _matrix(name: str, value: float, h: int, w: int) -> list[float]:
    """The AFFINE matrix of timm's shear / translate op at `value`."""
    if name == "ShearX":
        return [1.0, value, 0.0, 0.0, 1.0, 0.0]
    if name == "ShearY":
        return [1.0, 0.0, 0.0, value, 1.0, 0.0]
    if name == "TranslateXRel":  # timm: pct x width
        name, value = "TranslateX", value * w
    elif name == "TranslateYRel":
        name, value = "TranslateY", value * h
    if name == "TranslateX":
        return [1.0, 0.0, value, 0.0, 1.0, 0.0]
    return [1.0, 0.0, 0.0, 0.0, 1.0, value]


class DeviceAugment:
    """DeiT III's 3-Augment (`three_augment`), colour jitter (`color_jitter`, its
    strength) and the policy of TRAIN.AUGMENT `augment` (RandAugment or AutoAugment,
    geometric ops at `interpolation`), in that order, on uint8 (B, 3, H, W) batches."""

    def __init__(
        self,
        augment: str = "",
        interpolation: str = "random",
        three_augment: bool = False,
        color_jitter: float = 0.0,
    ) -> None:
        self.augment = augment
        self.interpolation = interpolation
        self.three_augment = three_augment
        self.color_jitter = color_jitter
        self._policies = {}
        if augment:
            self.policy(32)  # refuses unsupported policies now, not at a batch

    def policy(self, im_size: int):
        """The tensor policy at `im_size` (AutoAugment's absolute translations scale
        with it), built once per size; None without TRAIN.AUGMENT."""
        if not self.augment:
            return None
        policy = self._policies.get(im_size)
        if policy is None:
            timm_policy = make_augment(self.augment, im_size, self.interpolation)
            policy = policies.from_timm(timm_policy)
            refusal = f"TRAIN.AUGMENT {self.augment!r}, TRAIN.AUGMENT_BACKEND device"
            if isinstance(policy, policies.RandAugment):
                ops = policy.ops
            elif isinstance(policy, policies.AutoAugment):
                ops = [op for sub in policy.policy for op in sub]
            else:
                raise ConfigError(
                    f"{refusal}: AugMix runs on the host only (TRAIN.AUGMENT_BACKEND "
                    "tensor)"
                )
            missing = sorted({op.name for op in ops} - SUPPORTED)
            if missing:
                raise ConfigError(
                    f"{refusal}: no batched form of {', '.join(missing)} (use "
                    "TRAIN.AUGMENT_BACKEND tensor)"
                )
            self._policies[im_size] = policy
        return policy

    def draw(self, batch_size: int, im_size: int, rng: random.Random) -> list[list]:
        """Per image, per layer: (op name, args, resample, fill) or None (skipped),
        drawn in the host's order from `rng` (resample and fill: geometric ops')."""
        policy = self.policy(im_size)
        out = []
        for _ in range(batch_size):
            layers = []
            if self.three_augment:  # augment.three_augment_tensor's draws
                choice = rng.randrange(3)
                if choice == 0:
                    layers.append(("Grayscale", (), None, None))
                elif choice == 1:
                    args = (deit.SOLARIZE_THRESHOLD,)
                    layers.append(("Solarize", args, None, None))
                else:
                    radius = rng.uniform(*deit.BLUR_RADIUS)
                    layers.append(("GaussianBlur", (radius,), None, None))
            if self.color_jitter:
                order, factors = deit.jitter_params(self.color_jitter, rng)
                for k in order:
                    layers.append((_JITTER[k], (factors[k],), None, None))
            if policy is not None:
                layers.extend(_policy_draws(policy, rng))
            out.append(layers)
        return out

    def __call__(self, images: torch.Tensor, rng: random.Random) -> torch.Tensor:
        """`images`: uint8 (B, 3, H, W) on any device; returns them augmented (a new
        tensor when any op applies), each image by its own draws from `rng`."""
        b, _, h, w = images.shape
        draws = self.draw(b, w, rng)
        out = None
        for layer in range(max((len(d) for d in draws), default=0)):
            members = [
                (i, *layers[layer])
                for i, layers in enumerate(draws)
                if layer < len(layers) and layers[layer] is not None
            ]
            if members:
                out = images.clone() if out is None else out
                _apply_layer(out, members)
        return images if out is None else out


def _policy_draws(policy, rng: random.Random) -> list:
    """One image's layers of a RandAugment / AutoAugment policy, in timm's order:
    op choice, then per op whether it applies, its arguments and its interpolation
    (or GaussianBlurRand's radius, which its op draws)."""
    if isinstance(policy, policies.RandAugment):
        ops = policy.choose(rng)
    else:
        ops = rng.choice(policy.policy)
    layers = []
    for op in ops:
        args = op.draw(rng)
        if args is None:
            layers.append(None)
            continue
        name, resample = op.name, None
        if name in _GEOMETRIC:
            resample = op.draw_resample(rng)
        elif name == "GaussianBlurRand":  # policies._gaussian_blur_rand's draw
            name, args = "GaussianBlur", (rng.uniform(0.1, 2.0 * args[0]),)
        layers.append((name, args, resample, op.fill))
    return layers


def apply_op(images, name: str, members: list, resample: int, fill) -> None:
    """Runs timm's op `name` on the rows of `images` (uint8 (B, 3, H, W)) that
    `members` lists as (index, op arguments) pairs, in place."""
    _apply_layer(images, [(i, name, args, resample, fill) for i, args in members])


def _apply_layer(images, members: list) -> None:
    """One layer: (index, op name, args, resample, fill) per image that drew an op,
    each op (or warp) run once over its images, in place."""
    _, _, h, w = images.shape
    groups = defaultdict(list)
    for i, name, args, resample, fill in members:
        key, args = _group(name, args, resample, fill, h, w)
        if key is not None:
            groups[key].append((i, args))
    for key, group in groups.items():
        _run(images, *key, group)


def _group(name, args, resample, fill, h, w):
    """(what runs the op, its arguments): geometric ops become one affine warp per
    interpolation and fill (one batched warp for all of a layer's rotations, shears
    and translations), Pillow's rotate shortcuts (0: a copy, None; 180, and 90 / 270
    of a square: a transpose) stay apart; other ops run by name."""
    if name not in _GEOMETRIC:
        return (name, None, fill), args
    if name == "Rotate":
        angle = args[0] % 360.0
        if angle == 0:
            return None, None
        if angle == 180 or (angle in (90, 270) and w == h):
            return ("Transpose", None, fill), (angle,)
        return ("Affine", resample, fill), geometry_ops.rotation_matrix(args[0], w, h)
    return ("Affine", resample, fill), _matrix(name, args[0], h, w)


def _run(images, name, resample, fill, members) -> None:
    """Runs `name` (an op, "Affine" with matrices, "Transpose" with angles) on the
    rows `members` lists ((index, args) pairs) of `images`, in place."""
    if name == "Transpose":
        for i, (angle,) in members:
            if angle == 180:
                images[i] = images[i].flip((1, 2))
            else:
                images[i] = torch.rot90(images[i], 1 if angle == 90 else -1, (1, 2))
        return
    if name == "GaussianBlur":
        members = _blur_members(members)
        if not members:
            return
    index = _to([i for i, _ in members], torch.int64, images.device)
    x = images.index_select(0, index)
    images.index_copy_(0, index, _batched(name, x, members, resample, fill))


def _batched(name, x, members, resample, fill) -> torch.Tensor:
    """`name` on `x`, the members' rows, with each member's arguments."""
    device = x.device
    if name == "GaussianBlur":
        weights = [w for _, w in members]
        radius, inner, outer = (
            _to([w[k] for w in weights], torch.int64, device) for k in range(3)
        )
        biggest = max(w[0] for w in weights)
        return batch_ops.gaussian_blur(x, radius, inner, outer, biggest)
    if name == "Affine":
        matrices = _to([list(m) for _, m in members], torch.float64, device)
        fill_t = _to(list(fill), torch.uint8, device)
        return batch_ops.affine(x, matrices, resample, fill_t)
    values = [args[0] if args else 0.0 for _, args in members]
    if name in _PLAIN:
        return _PLAIN[name](x)
    if name in _BLENDS:
        if name == "Desaturate":  # timm: colour at 1 - factor, within [0, 1]
            values = [min(1.0, max(0.0, 1.0 - v)) for v in values]
        return _BLENDS[name](x, _to(values, torch.float64, device).to(torch.float32))
    if name.startswith("Posterize") or name == "SolarizeAdd":
        op = batch_ops.posterize if name != "SolarizeAdd" else batch_ops.solarize_add
        return op(x, _to([int(v) for v in values], torch.int64, device))
    return batch_ops.solarize(x, _to(values, torch.float64, device))


def _blur_members(members) -> list:
    """GaussianBlur's (index, box weights) pairs, the images whose box radius is 0
    left out (Pillow returns them unchanged)."""
    out = []
    for i, (radius,) in members:
        box = batch_ops.box_blur_radius(radius)
        if radius != 0 and box != 0:
            out.append((i, batch_ops.box_weights(box)))
    return out
