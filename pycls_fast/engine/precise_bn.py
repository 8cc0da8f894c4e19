"""BN.USE_PRECISE_STATS in a training run: the BatchNorm statistics of the conv stem
recomputed after each epoch over BN.NUM_SAMPLES_PRECISE training images
(components/precise_bn.py); a no-op, said once, for models without BatchNorm."""

import logging

from pycls_fast.components.precise_bn import (
    batch_norms,
    compute_precise_bn_stats,
    precise_iters,
)
from pycls_fast.components.precision import input_dtype
from pycls_fast.datasets.to_device.transform import DeviceBatchTransform
from pycls_fast.runtime import distributed

logger = logging.getLogger(__name__)

# Whether this process said that the model has no BatchNorm (once per process).
_said_no_bn: list[bool] = []


def update_precise_bn(parts, epoch: int) -> None:
    """Recomputes the BatchNorm statistics of `parts.model` from the training images
    of `epoch` (their crops as trained, normalized without the random device-side
    augmentations, so that the training batches' random streams are untouched)."""
    if not batch_norms(parts.model):
        if not _said_no_bn:
            logger.info(
                "BN.USE_PRECISE_STATS: this model has no BatchNorm (only the conv "
                "stem, VIT.STEM_TYPE conv, has): nothing to recompute"
            )
            _said_no_bn.append(True)
        return
    cfg, loader = parts.cfg, parts.train_loader
    loader.set_epoch(epoch)  # the epoch just trained; stateless, train_epoch resets it
    prepare = DeviceBatchTransform(
        cfg, parts.device, input_dtype(parts.mode, parts.half_dtype), False
    )
    per_rank = cfg.TRAIN.BATCH_SIZE // parts.layout.dp
    num_iter = precise_iters(
        cfg.BN.NUM_SAMPLES_PRECISE, per_rank, parts.layout.dp, len(loader)
    )
    # As many forwards on every rank (FSDP gathers in each): the fewest any has.
    num_iter = -int(distributed.all_reduce_max([-float(num_iter)])[0])
    inputs = (prepare(images, labels)[0] for images, labels in loader)
    with parts.autocast():
        used = compute_precise_bn_stats(parts.model, inputs, num_iter)
    logger.info(
        "BN.USE_PRECISE_STATS: %d BatchNorm layer(s) recomputed over %d batch(es) of "
        "%d images per rank",
        len(batch_norms(parts.model)),
        used,
        per_rank,
    )
