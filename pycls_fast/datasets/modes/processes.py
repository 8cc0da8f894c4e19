"""'processes' mode: torch's DataLoader with worker processes, the baseline.

Same per-image work as the threaded mode (ImageDecoder.load, same seeds, so the same
batches); each worker process decodes whole batches and sends them to the training
process through shared memory. Kept for comparison (benchmarks/loader.py) and as a
fallback.
"""

import functools
from collections.abc import Iterable, Iterator

import numpy as np
import torch.utils.data

from pycls_fast.datasets.modes.batch import Batch, ImageDecoder, make_batch


class _EpochDataset(torch.utils.data.Dataset):
    """Map-style dataset over a FileIndex for one epoch; items are `ImageDecoder.load`'s
    (uint8 HWC array or None, label, bad images met)."""

    def __init__(self, decoder, epoch):
        self.decoder = decoder
        self.epoch = epoch

    def __len__(self):
        return len(self.decoder.index)

    def __getitem__(self, i):
        return self.decoder.load(i, self.epoch)


def _collate(shape, items):
    """Stacks the good images of a batch into one uint8 array; lists the bad ones.

    In a worker, the array is allocated in shared memory (as torch's default_collate
    does), so that sending the batch to the training process copies nothing.
    """
    good = [(x, y) for x, y, _ in items if x is not None]
    bad = [b for _, _, found in items for b in found]
    out = torch.empty((len(good), *shape), dtype=torch.uint8)
    if torch.utils.data.get_worker_info() is not None:
        out.share_memory_()
    if good:
        np.stack([x for x, _ in good], out=out.numpy())
    return make_batch(out, [y for _, y in good], bad)


def iterate_processes(
    decoder: ImageDecoder,
    batches: Iterable[np.ndarray],
    epoch: int,
    num_workers: int,
    prefetch: int,
) -> Iterator[Batch]:
    """Yields one Batch per index array of `batches`, in order, decoded by
    `num_workers` worker processes (0: in this process), `prefetch` batches ahead in
    total (torch's prefetch_factor is per worker)."""
    kwargs = {}
    if num_workers > 0:
        kwargs["prefetch_factor"] = max(1, -(-prefetch // num_workers))
    loader = torch.utils.data.DataLoader(
        _EpochDataset(decoder, epoch),
        batch_sampler=[b.tolist() for b in batches],
        num_workers=num_workers,
        collate_fn=functools.partial(_collate, decoder.shape),
        pin_memory=decoder.pin_memory,
        **kwargs,
    )
    yield from loader
