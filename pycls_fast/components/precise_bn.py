"""pycls's precise BatchNorm statistics (BN.USE_PRECISE_STATS): after a training
epoch, each BatchNorm's running mean and variance are replaced by their average over
BN.NUM_SAMPLES_PRECISE training images, batch by batch (pycls's
`compute_precise_bn_stats`), so that evaluation normalizes with the statistics of
the final weights rather than a moving average over the whole epoch. In a ViT only
the conv stem (VIT.STEM_TYPE conv, ViT-C) has BatchNorm; other models have none.

`update_precise_bn` is the training run's call after each epoch (a no-op, said
once, for models without BatchNorm).
"""

import itertools
import logging
from collections.abc import Iterable

import torch

from pycls_fast.components.precision import input_dtype
from pycls_fast.datasets.to_device.transform import DeviceBatchTransform
from pycls_fast.runtime import distributed

logger = logging.getLogger(__name__)

# Whether this process said that the model has no BatchNorm (once per process).
_said_no_bn: list[bool] = []


def batch_norms(model: torch.nn.Module) -> list[torch.nn.modules.batchnorm._BatchNorm]:
    """The BatchNorm layers of `model`, in module order."""
    return [
        m
        for m in model.modules()
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
    ]


def precise_iters(num_samples: int, batch_per_rank: int, world: int, available: int):
    """Batches per rank that make about `num_samples` images over all ranks (pycls's
    NUM_SAMPLES_PRECISE / batch / NUM_GPUS), at least one, at most `available`."""
    return max(1, min(num_samples // max(batch_per_rank * world, 1), available))


@torch.no_grad()
def compute_precise_bn_stats(
    model: torch.nn.Module, inputs: Iterable[torch.Tensor], num_iter: int
) -> int:
    """Sets each BatchNorm's running mean and var of `model` (in train mode, so
    that BatchNorm uses batch statistics) to their average over the first `num_iter`
    batches of `inputs` (float (B, 3, H, W) on the model's device), averaged over
    the ranks too; the momentum is restored. Returns the batches used (0: no BN)."""
    bns = batch_norms(model)
    if not bns:
        return 0
    means = [torch.zeros_like(bn.running_mean) for bn in bns]
    variances = [torch.zeros_like(bn.running_var) for bn in bns]
    momenta = [bn.momentum for bn in bns]
    for bn in bns:
        bn.momentum = 1.0  # running stats = this batch's
    was_training = model.training
    model.train()
    used = 0
    for x in itertools.islice(inputs, num_iter):
        model(x)
        used += 1
        for i, bn in enumerate(bns):
            means[i] += bn.running_mean
            variances[i] += bn.running_var
    stats = [t / max(used, 1) for t in means + variances]
    world = distributed.world_size()
    if world > 1:  # every rank's average, averaged (pycls's scaled_all_reduce)
        flat = torch.cat([t.flatten() for t in stats])
        torch.distributed.all_reduce(flat)
        stats = list((flat / world).split([t.numel() for t in stats]))
    for i, bn in enumerate(bns):
        bn.running_mean.copy_(stats[i])
        bn.running_var.copy_(stats[len(bns) + i])
        bn.momentum = momenta[i]
    model.train(was_training)
    return used


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
