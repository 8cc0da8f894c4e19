"""Device-side batch preparation: copy, normalize, PCA lighting, mixup / cutmix, labels.

Batches travel as uint8 (4x less to copy than float32) and become floats on the device,
in the training dtype:

    prepare = DeviceBatchTransform(cfg, device, torch.bfloat16, train=True)
    for images, labels in loader:
        inputs, targets = prepare(images, labels)   # float (B, 3, H, W), targets

The pieces are plain functions too: `to_device`, `normalize`, `pca_lighting_offsets`,
`erase_boxes`, `erase_batch`, `one_hot`, `mix_batch`.
"""

import functools
import logging
import math
import random
from collections.abc import Sequence

import numpy as np
import torch
from yacs.config import CfgNode

from pycls_fast.datasets.to_device.augment_policy import DeviceAugment

logger = logging.getLogger(__name__)

# pycls's ImageNet statistics, in RGB order, in [0, 1] units: the defaults of
# DATA.MEAN and DATA.STD, which DeviceBatchTransform reads.
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
# AlexNet PCA lighting: eigenvalues and eigenvectors (columns) of the RGB covariance.
EIG_VALS = (0.2175, 0.0188, 0.0045)
EIG_VECS = (
    (-0.5675, 0.7192, 0.4009),
    (-0.5808, -0.0045, -0.8140),
    (-0.5836, -0.6948, 0.4203),
)


def to_device(
    images: torch.Tensor,
    labels: torch.Tensor,
    device: torch.device | str,
    pin_memory: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies a host batch to `device`; returns (images, labels), still uint8 / int64.

    `images`: uint8 (B, 3, H, W); `labels`: int64 (B,); shapes are kept.

    On CUDA the copies are non-blocking from pinned memory (pinned here unless the
    loader already allocated the batch pinned), so they overlap with compute.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return images.to(device), labels.to(device)
    if pin_memory and not images.is_pinned():
        images, labels = images.pin_memory(), labels.pin_memory()
    return (
        images.to(device, non_blocking=True),
        labels.to(device, non_blocking=True),
    )


def normalize(
    images: torch.Tensor,
    mean: Sequence[float] = MEAN,
    std: Sequence[float] = STD,
    dtype: torch.dtype = torch.float32,
    offsets: torch.Tensor | None = None,
) -> torch.Tensor:
    """Returns (images / 255 + offsets - mean) / std as `dtype`, on images' device.

    `images`: uint8 (B, 3, H, W); `mean`, `std`: 3 values in [0, 1] units;
    `offsets`: optional float (B, 3) per-image colour shift in [0, 1] units (PCA
    lighting). Computed in float32 and rounded once to `dtype`; the memory format
    (channels-last) is kept.
    """
    std_t, scale, shift = _constants(tuple(mean), tuple(std), images.device)
    shift = shift.view(1, 3) if offsets is None else shift + offsets.float()
    bias = (shift / std_t).view(-1, 3, 1, 1)
    return torch.addcmul(bias, images.float(), scale).to(dtype)


@functools.lru_cache(maxsize=8)
def _constants(mean, std, device):
    """std, 1 / (255 std) and -mean as float32 tensors on `device`, made once (a
    tensor made from Python values on a GPU is a synchronous copy)."""
    std_t = torch.tensor(std, dtype=torch.float32, device=device)
    scale = (1.0 / (255.0 * std_t)).view(1, 3, 1, 1)
    return std_t, scale, -torch.tensor(mean, dtype=torch.float32, device=device)


def pca_lighting_offsets(
    batch_size: int,
    alpha_std: float,
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Returns float32 (B, 3) AlexNet-style PCA lighting shifts, in [0, 1] RGB units.

    Per image: eig_vecs @ (alpha * eig_vals) with alpha ~ N(0, alpha_std) (pycls's
    `lighting`, added to the [0, 1] image before normalization). Drawn on the
    generator's device (else on `device`): no host draw, no host-to-device copy.
    """
    device = generator.device if generator is not None else torch.device(device)
    alpha = torch.randn(batch_size, 3, generator=generator, device=device) * alpha_std
    vecs, vals = _eigen(device)
    return (alpha * vals) @ vecs.T


@functools.lru_cache(maxsize=8)
def _eigen(device):
    """EIG_VECS and EIG_VALS as float32 tensors on `device`, made once."""
    vecs = torch.tensor(EIG_VECS, dtype=torch.float32, device=device)
    return vecs, torch.tensor(EIG_VALS, dtype=torch.float32, device=device)


def erase_boxes(
    rng: random.Random,
    height: int,
    width: int,
    probability: float,
    max_count: int = 1,
    min_area: float = 0.02,
    max_area: float = 1 / 3,
    min_aspect: float = 0.3,
) -> list[tuple[int, int, int, int]]:
    """The (top, left, h, w) boxes that timm's RandomErasing erases in one image: the
    same draws, in the same order, from `rng` (a `random.Random`) instead of the
    global `random`, so the same seed gives the same boxes as timm."""
    if rng.random() > probability:
        return []
    area = height * width
    count = 1 if max_count == 1 else rng.randint(1, max_count)
    log_aspect = (math.log(min_aspect), math.log(1 / min_aspect))
    boxes = []
    for _ in range(count):
        for _ in range(10):
            target = rng.uniform(min_area, max_area) * area / count
            aspect = math.exp(rng.uniform(*log_aspect))
            h = int(round(math.sqrt(target * aspect)))
            w = int(round(math.sqrt(target / aspect)))
            if w < width and h < height:
                top = rng.randint(0, height - h)
                left = rng.randint(0, width - w)
                boxes.append((top, left, h, w))
                break
    return boxes


def erase_batch(
    inputs: torch.Tensor,
    boxes: torch.Tensor,
    mode: str = "pixel",
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Returns `inputs` (float (B, C, H, W), normalized) with the boxes erased.

    `boxes`: int64 (B, K, 4) of (top, left, h, w), h = 0 for no box, on inputs' device.
    Fill: 'pixel' per-pixel N(0, 1) noise, 'rand' one N(0, 1) colour per box, 'const'
    zeros (timm's modes). Whole-batch operations: no per-image kernel launches.
    """
    b, c, height, width = inputs.shape
    ys = torch.arange(height, device=inputs.device).view(1, 1, height, 1)
    xs = torch.arange(width, device=inputs.device).view(1, 1, 1, width)
    top, left, h, w = (v.view(b, -1, 1, 1) for v in boxes.unbind(-1))
    masks = (ys >= top) & (ys < top + h) & (xs >= left) & (xs < left + w)  # (B,K,H,W)
    if mode == "rand":
        colors = torch.randn(
            b, masks.shape[1], c, 1, 1, generator=generator, device=inputs.device
        ).to(inputs.dtype)
        out = inputs
        for k in range(masks.shape[1]):
            out = torch.where(masks[:, k : k + 1], colors[:, k], out)
        return out
    mask = masks.any(1, keepdim=True)
    # Written into a tensor like `inputs`: a (B, 1, H, W) mask would otherwise
    # give a contiguous result for a channels-last batch.
    out = torch.empty_like(inputs)
    if mode == "const":
        return torch.where(mask, inputs.new_zeros(()), inputs, out=out)
    noise = torch.randn(
        inputs.shape, generator=generator, device=inputs.device, dtype=inputs.dtype
    )
    return torch.where(mask, noise, inputs, out=out)


def one_hot(
    labels: torch.Tensor, num_classes: int, smoothing: float = 0.0
) -> torch.Tensor:
    """`labels`: int64 (B,). Returns float32 (B, num_classes) targets:
    1 - smoothing + smoothing / n on the label, smoothing / n elsewhere (pycls's
    smooth_one_hot_labels)."""
    off = smoothing / num_classes
    out = torch.full((len(labels), num_classes), off, device=labels.device)
    return out.scatter_(1, labels.view(-1, 1), 1.0 - smoothing + off)


def cutmix_box(
    height: int, width: int, lam: float, rng: np.random.Generator
) -> tuple[int, int, int, int]:
    """Returns (top, bottom, left, right) of a box of about (1 - lam) of the area,
    centred uniformly at random and clipped to the image (timm's rand_bbox)."""
    ratio = math.sqrt(1.0 - lam)
    cut_h, cut_w = int(height * ratio), int(width * ratio)
    cy, cx = int(rng.integers(height)), int(rng.integers(width))
    top, bottom = max(cy - cut_h // 2, 0), min(cy + cut_h // 2, height)
    left, right = max(cx - cut_w // 2, 0), min(cx + cut_w // 2, width)
    return top, bottom, left, right


def mix_batch(
    images: torch.Tensor,
    targets: torch.Tensor,
    mixup_alpha: float,
    cutmix_alpha: float,
    rng: np.random.Generator,
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Mixes each image with the image at the mirrored batch position (timm's 'batch'
    mode: partner of i is B-1-i) and its soft target with the same weight.

    `images`: float (B, 3, H, W); `targets`: float (B, n); `rng`: numpy Generator.
    Mixup: lam ~ Beta(mixup_alpha); images = lam * x + (1 - lam) * partner. CutMix:
    lam ~ Beta(cutmix_alpha), a box of about 1 - lam of the area is pasted from the
    partner, and lam is corrected to the exact pasted area. With both alphas > 0, one
    of the two is picked per batch with probability 1/2. Returns (images, targets, lam).
    """
    use_cutmix = cutmix_alpha > 0 and (mixup_alpha <= 0 or rng.random() < 0.5)
    if use_cutmix:
        lam = float(rng.beta(cutmix_alpha, cutmix_alpha))
        h, w = images.shape[-2:]
        top, bottom, left, right = cutmix_box(h, w, lam, rng)
        images = images.clone()
        images[:, :, top:bottom, left:right] = images.flip(0)[
            :, :, top:bottom, left:right
        ]
        lam = 1.0 - (bottom - top) * (right - left) / (h * w)
    elif mixup_alpha > 0:
        lam = float(rng.beta(mixup_alpha, mixup_alpha))
        images = images * lam + images.flip(0) * (1.0 - lam)
    else:
        return images, targets, 1.0
    targets = targets * lam + targets.flip(0) * (1.0 - lam)
    return images, targets, lam


class DeviceBatchTransform:
    """Turns a host batch into model inputs and loss targets on `device`.

    Train: uint8 -> device -> with TRAIN.AUGMENT_BACKEND device, TRAIN.THREE_AUGMENT,
    TRAIN.COLOR_JITTER and TRAIN.AUGMENT (augment_policy.py) -> PCA lighting
    (TRAIN.PCA_STD) + normalize in `dtype` -> random erasing (TRAIN.RANDOM_ERASE*)
    -> mixup / cutmix (TRAIN.MIXUP_ALPHA, TRAIN.CUTMIX_ALPHA) with label smoothing
    (TRAIN.LABEL_SMOOTHING). Targets are float32 (B, MODEL.NUM_CLASSES) probabilities
    when any of those three is on, else the int64 (B,) labels; both are accepted by
    torch's cross_entropy. Test: normalize only; targets are the labels.
    Random draws come from generators seeded with RNG_SEED (and `rank`): a numpy
    Generator on the host (mixup / cutmix choices) and a torch Generator on `device`
    (PCA lighting, drawn where it is used). On a CPU the draws are those of a CPU
    generator; a CUDA generator seeded alike draws another (equally valid) stream.
    `state_dict()` / `load_state_dict()` carry both states across a resume.
    """

    def __init__(
        self,
        cfg: CfgNode,
        device: torch.device | str,
        dtype: torch.dtype = torch.float32,
        train: bool = True,
        rank: int = 0,
    ) -> None:
        self.device = device
        self.dtype = dtype
        self.train = train
        self.pin_memory = cfg.DATA_LOADER.PIN_MEMORY
        self.pca_std = cfg.TRAIN.PCA_STD
        self.mixup_alpha = cfg.TRAIN.MIXUP_ALPHA
        self.cutmix_alpha = cfg.TRAIN.CUTMIX_ALPHA
        self.smoothing = cfg.TRAIN.LABEL_SMOOTHING
        self.erase = cfg.TRAIN.RANDOM_ERASE
        self.erase_mode = cfg.TRAIN.RANDOM_ERASE_MODE
        self.erase_count = cfg.TRAIN.RANDOM_ERASE_COUNT
        self.num_classes = cfg.MODEL.NUM_CLASSES
        self.bgr = cfg.DATA.CHANNEL_ORDER == "bgr"
        self.mean, self.std = tuple(cfg.DATA.MEAN), tuple(cfg.DATA.STD)
        self.augment = None
        t = cfg.TRAIN
        augments = t.AUGMENT or t.THREE_AUGMENT or t.COLOR_JITTER
        if train and t.AUGMENT_BACKEND == "device" and augments:
            self.augment = DeviceAugment(
                t.AUGMENT, t.AUGMENT_INTERPOLATION, t.THREE_AUGMENT, t.COLOR_JITTER
            )
        seed = [cfg.RNG_SEED, rank]
        self.rng = np.random.default_rng(seed)
        self.generator = torch.Generator(device=torch.device(device)).manual_seed(
            int(self.rng.integers(2**62))
        )

    def state_dict(self) -> dict:
        """The random state: {"numpy": the numpy bit generator's state (a dict of str
        and int), "torch": the torch generator's state (uint8 CPU tensor), "device":
        its device type ('cpu', 'cuda')}; loads with torch.load(weights_only=True)."""
        return {
            "numpy": self.rng.bit_generator.state,
            "torch": self.generator.get_state(),
            "device": self.generator.device.type,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restores the random state saved by `state_dict`. A torch generator state
        of another device type (a CPU-written checkpoint resumed on CUDA, or the
        reverse: the states differ in size) leaves the device generator as seeded,
        with a log line, as checkpoint/state.py does for the global CUDA RNG."""
        self.rng.bit_generator.state = state["numpy"]
        saved = state.get("device")
        own = self.generator.device.type
        if saved is not None and saved != own:
            logger.info(
                "batch RNG state of the checkpoint not restored (saved on %s, "
                "running on %s): seeded",
                saved,
                own,
            )
            return
        try:
            self.generator.set_state(state["torch"].to("cpu", torch.uint8))
        except (RuntimeError, ValueError) as e:  # an untagged, older checkpoint
            logger.info(
                "batch RNG state of the checkpoint not restored (%s): seeded", e
            )

    def _random_erase(self, inputs):
        """timm's RandomErasing per image: boxes drawn on the host (a `random.Random`
        seeded from this transform's numpy generator, so a resume redraws them),
        noise on the device from its generator."""
        rng = random.Random(int(self.rng.integers(2**63)))
        b, _, height, width = inputs.shape
        boxes = np.zeros((b, self.erase_count, 4), dtype=np.int64)
        for i in range(b):
            for k, box in enumerate(
                erase_boxes(rng, height, width, self.erase, self.erase_count)
            ):
                boxes[i, k] = box
        if not boxes[..., 2].any():
            return inputs
        boxes_t = torch.from_numpy(boxes)
        if inputs.device.type == "cuda":  # no host sync: a pinned, async copy
            boxes_t = boxes_t.pin_memory().to(inputs.device, non_blocking=True)
        else:
            boxes_t = boxes_t.to(inputs.device)
        return erase_batch(inputs, boxes_t, self.erase_mode, self.generator)

    def _ordered(self, inputs: torch.Tensor) -> torch.Tensor:
        # pycls's loader feeds BGR, each channel normalized by its own mean and std:
        # normalizing in RGB, then reversing the channels, is the same.
        if not self.bgr:
            return inputs
        return inputs.flip(1).contiguous(memory_format=torch.channels_last)

    def __call__(
        self, images: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`images`: uint8 (B, 3, H, W), `labels`: int64 (B,) on the host; returns
        (inputs `dtype` (B, 3, H, W), targets) on the device."""
        images, labels = to_device(images, labels, self.device, self.pin_memory)
        if not self.train:
            inputs = normalize(images, self.mean, self.std, self.dtype)
            return self._ordered(inputs), labels
        if self.augment is not None:
            # Drawn from a generator seeded by this transform's numpy one, as the
            # erasing boxes are: a resume redraws the same.
            images = self.augment(images, random.Random(int(self.rng.integers(2**63))))
        offsets = None
        if self.pca_std > 0:
            offsets = pca_lighting_offsets(
                len(labels), self.pca_std, self.generator, images.device
            )
        inputs = normalize(images, self.mean, self.std, self.dtype, offsets)
        inputs = self._ordered(inputs)
        if self.erase > 0:
            inputs = self._random_erase(inputs)
        mixing = self.mixup_alpha > 0 or self.cutmix_alpha > 0
        if not mixing and self.smoothing == 0:
            return inputs, labels
        targets = one_hot(labels, self.num_classes, self.smoothing)
        inputs, targets, _ = mix_batch(
            inputs, targets, self.mixup_alpha, self.cutmix_alpha, self.rng
        )
        return inputs, targets
