"""Which images each rank reads, in which order, per epoch.

Train: every rank draws the same order of the images from (seed, epoch), takes every
world_size-th image from its rank on, and drops the tail so that every rank yields the
same number of full batches (pycls drops the last partial train batch too). The order
is a permutation of all images for a folder, and for tar shards the shards in a
permuted order with the images shuffled within windows of consecutive images
(`shard_order`). Either way the order does not depend on the number of ranks: N ranks
together see, batch by batch, what one process sees.
Test: the images are split between ranks without shuffling, padding or dropping, so
each image is evaluated exactly once across ranks; the last batch may be partial.
"""

import numpy as np


def rank_and_world_size(
    rank: int | None = None, world_size: int | None = None
) -> tuple[int, int]:
    """Returns (rank, world_size): the arguments when given, else torch.distributed's
    when it is initialized, else (0, 1)."""
    if rank is not None and world_size is not None:
        return rank, world_size
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def train_batches(
    num_images: int, batch_size: int, seed: int, epoch: int, rank: int, world_size: int
) -> list[np.ndarray]:
    """Returns this rank's train batches for `epoch`: a list of int64 index arrays,
    each of `batch_size`, the same count on every rank, disjoint across ranks."""
    order = np.random.default_rng([seed, epoch]).permutation(num_images)
    return split_order(order, batch_size, rank, world_size)


def split_order(
    order: np.ndarray, batch_size: int, rank: int, world_size: int
) -> list[np.ndarray]:
    """Cuts an epoch's order of image indices (int64 (N,)) into this rank's batches:
    every world_size-th image from `rank` on, the same number of full batches on
    every rank."""
    num_images = len(order)
    per_rank = num_images // world_size
    num_batches = per_rank // batch_size
    mine = order[rank::world_size][: num_batches * batch_size]
    return np.split(mine, num_batches) if num_batches else []


def shard_order(counts: np.ndarray, seed: int, epoch: int, window: int) -> np.ndarray:
    """The epoch's order of the images of tar shards: int64 (N,).

    `counts` (S,): images per shard, whose images are contiguous indices in shard
    order. The shards are permuted from (seed, epoch); then the images are shuffled
    within consecutive windows of `window` images (a shuffle buffer that spans a few
    shards), so that a rank reads from a few open shards at a time. O(N) time and
    memory."""
    rng = np.random.default_rng([seed, epoch, 1])
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    perm = rng.permutation(len(counts))
    order = np.concatenate(
        [np.arange(starts[s], starts[s] + counts[s], dtype=np.int64) for s in perm]
    )
    for begin in range(0, len(order), window):
        rng.shuffle(order[begin : begin + window])  # In place, on a view.
    return order


def repeat_order(order: np.ndarray, repeats: int) -> np.ndarray:
    """Repeated augmentation (DeiT's RASampler): each image of `order` `repeats` times
    in a row, cut to the epoch's length len(order); copy c of image i is the virtual
    index i + c x N (its own crop and augmentation seeds). Split between ranks, the
    copies of an image go to consecutive ranks in the same step, as DeiT's sampler
    sends them."""
    if repeats <= 1:
        return order
    n = len(order)
    copies = np.tile(np.arange(repeats, dtype=np.int64), n)[:n]
    return np.repeat(order, repeats)[:n] + copies * n


def num_train_batches(num_images: int, batch_size: int, world_size: int) -> int:
    """Train batches per rank per epoch (len of `train_batches`)."""
    return num_images // world_size // batch_size


def test_batches(
    num_images: int, batch_size: int, rank: int, world_size: int
) -> list[np.ndarray]:
    """Returns this rank's test batches: a contiguous slice of the images (in index
    order) cut into batches of `batch_size`, the last one possibly smaller. The slices
    of all ranks cover every image exactly once."""
    bounds = np.linspace(0, num_images, world_size + 1).astype(np.int64)
    mine = np.arange(bounds[rank], bounds[rank + 1], dtype=np.int64)
    return [mine[i : i + batch_size] for i in range(0, len(mine), batch_size)]
