"""TRAIN.LOSS: cross-entropy, and binary cross-entropy as timm and DeiT III compute
it, on the targets the device transform makes (labels, smoothing, mixup / cutmix)."""

import pytest
import torch
import torch.nn.functional as F
from timm.loss import BinaryCrossEntropy

from pycls_fast.components.losses import build_loss
from pycls_fast.config import check_cfg, get_cfg
from pycls_fast.datasets.to_device.transform import DeviceBatchTransform
from pycls_fast.errors import ConfigError


def _batch(cfg):
    prep = DeviceBatchTransform(cfg, "cpu")
    images = torch.randint(0, 255, (8, 3, 16, 16), dtype=torch.uint8)
    _, targets = prep(images, torch.tensor([0, 1, 2, 3, 4, 0, 1, 2]))
    logits = torch.randn(8, cfg.MODEL.NUM_CLASSES, generator=torch.Generator())
    return logits, targets


@pytest.mark.parametrize(
    "over",
    [{}, {"LABEL_SMOOTHING": 0.1}, {"MIXUP_ALPHA": 0.8, "CUTMIX_ALPHA": 1.0}],
)
@pytest.mark.parametrize("thresh", [0.0, 0.2])
def test_bce_is_timms_binary_cross_entropy(over, thresh):
    cfg = get_cfg()
    cfg.MODEL.NUM_CLASSES, cfg.TRAIN.PCA_STD = 5, 0.0
    cfg.TRAIN.LOSS, cfg.TRAIN.BCE_TARGET_THRESH = "bce", thresh
    for key, value in over.items():
        cfg.TRAIN[key] = value
    logits, targets = _batch(cfg)
    want = BinaryCrossEntropy(smoothing=0.0, target_threshold=thresh or None)
    got = build_loss(cfg)(logits, targets)
    assert torch.equal(got, want(logits, targets))
    if not over:  # DeiT III: BCEWithLogitsLoss on one-hot labels
        one_hot = F.one_hot(targets, 5).float()
        assert torch.equal(got, F.binary_cross_entropy_with_logits(logits, one_hot))


def test_ce_is_cross_entropy():
    cfg = get_cfg()
    cfg.MODEL.NUM_CLASSES, cfg.TRAIN.LABEL_SMOOTHING = 5, 0.1
    logits, targets = _batch(cfg)
    assert torch.equal(
        build_loss(cfg)(logits, targets), F.cross_entropy(logits, targets)
    )


def test_bce_binary_targets_are_deit3s():
    # DeiT III (engine.py, --bce-loss): targets.gt(0.0) after mixup / cutmix, then
    # BCEWithLogitsLoss; timm's loss with target_threshold 0.0.
    cfg = get_cfg()
    cfg.MODEL.NUM_CLASSES, cfg.TRAIN.PCA_STD = 5, 0.0
    cfg.TRAIN.MIXUP_ALPHA, cfg.TRAIN.CUTMIX_ALPHA = 0.8, 1.0
    cfg.TRAIN.LOSS, cfg.TRAIN.BCE_BINARY_TARGETS = "bce", True
    logits, targets = _batch(cfg)
    assert ((targets > 0) & (targets < 1)).any()  # mixed: soft before binarizing
    got = build_loss(cfg)(logits, targets)
    deit3 = F.binary_cross_entropy_with_logits(logits, targets.gt(0.0).float())
    assert torch.equal(got, deit3)
    assert torch.equal(
        got, BinaryCrossEntropy(0.0, target_threshold=0.0)(logits, targets)
    )
    cfg.TRAIN.BCE_BINARY_TARGETS = False  # soft targets: another loss
    assert not torch.equal(build_loss(cfg)(logits, targets), deit3)


def test_bce_binary_targets_with_a_threshold_is_refused():
    cfg = get_cfg()
    cfg.TRAIN.BCE_BINARY_TARGETS, cfg.TRAIN.BCE_TARGET_THRESH = True, 0.2
    with pytest.raises(ConfigError, match="TRAIN.BCE_BINARY_TARGETS True is the"):
        check_cfg(cfg)
