"""The training loss: soft-target cross-entropy (pycls) or binary cross-entropy
(DeiT III, timm's BinaryCrossEntropy), chosen by TRAIN.LOSS.

Targets arrive as the device transform makes them: int64 (B,) labels, or float32
(B, classes) probabilities already mixed and smoothed; logits are float32 (B, classes).
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from yacs.config import CfgNode

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def build_loss(cfg: CfgNode) -> Loss:
    """The loss function (logits, targets) -> 0-d mean loss of TRAIN.LOSS."""
    if cfg.TRAIN.LOSS == "ce":
        return F.cross_entropy
    from timm.loss import BinaryCrossEntropy

    # timm binarizes with target > threshold whenever the threshold is not None: 0.0
    # is DeiT III's binary targets, and None keeps the soft ones.
    if cfg.TRAIN.BCE_BINARY_TARGETS:
        thresh = 0.0
    else:
        thresh = cfg.TRAIN.BCE_TARGET_THRESH or None
    # No smoothing here: label smoothing and mixup already shaped dense targets on the
    # device, and labels without them are one-hot (0 / 1), as DeiT III trains.
    return BinaryCrossEntropy(smoothing=0.0, target_threshold=thresh)
