"""The per-image work of both loader modes, and batch assembly into uint8 tensors.

Each image gets its own `random.Random` seeded from (seed, epoch, image index), so crops
and flips do not depend on which thread or process decodes the image, nor on the order:
the threaded and the process loader yield identical batches.
"""

import random
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import torch

from pycls_fast.datasets.formats.index import FileIndex
from pycls_fast.datasets.images.decode import DECODE_ERRORS, EncodedImage


class Batch(NamedTuple):
    """`images`: uint8 (B, 3, H, W), channels-last in memory (a permuted NHWC buffer,
    so no transpose on the host); `labels`: int64 (B,); `bad`: [(path, error)] of the
    images skipped in this batch (B is smaller by that many)."""

    images: torch.Tensor
    labels: torch.Tensor
    bad: list


def image_seed(seed: int, epoch: int, index: int) -> int:
    """The integer seed of image `index` in `epoch` (distinct for distinct triples)."""
    return ((seed * 1_000_003 + epoch) << 32) + int(index)


# Draws per bad image when replacing it, before its row is given up.
MAX_REPLACEMENTS = 16
# The virtual copy number of the first replacement draw: far above any repeat count
# (TRAIN.REPEATED_AUG), so a replacement's seed is never a repeat's.
REPLACEMENT_COPY = 1 << 20


class BufferPool:
    """Batch buffers handed out again once nothing refers to them any more.

    A fresh buffer per batch costs page faults on every write and, freed by another
    thread than the one that allocated it, grows glibc's heaps (the effect on peak
    memory is in docs/PERFORMANCE.md, "Data loader"). Each buffer is handed out as a
    view; when the view dies (the batch and every tensor made from it are gone), the
    base array returns here. At most `keep` idle buffers are kept; any number may be
    in use.
    """

    def __init__(self, keep: int = 8) -> None:
        self.keep = keep
        self._idle = []
        # Reentrant: a garbage collection inside get() may run a finalizer (_put) in
        # the thread that holds the lock.
        self._lock = threading.RLock()

    def get(self, shape: tuple[int, ...]) -> np.ndarray:
        """Returns an uninitialized uint8 array of `shape` (a view of a pooled one)."""
        with self._lock:
            for i, base in enumerate(self._idle):
                if base.shape == shape:
                    del self._idle[i]
                    break
            else:
                base = np.empty(shape, dtype=np.uint8)
        view = base[...]
        weakref.finalize(view, self._put, base)
        return view

    def _put(self, base):
        with self._lock:
            if len(self._idle) < self.keep:
                self._idle.append(base)


class ImageDecoder:
    """Decodes and transforms images of an index; picklable for worker processes.

    The index (a FileIndex or a ShardIndex) has `labels` (N,), `read(i)` -> bytes
    and `path(i)` -> the name of image `i` in logs.
    """

    def __init__(
        self,
        index: FileIndex,
        transform: Callable[[EncodedImage, random.Random, np.ndarray], None],
        im_size: int,
        seed: int,
        pin_memory: bool = False,
        replace_bad: bool = False,
    ) -> None:
        self.index = index
        # A bad image's row gets another image instead of being dropped (batches of
        # a fixed size: CUDA graphs, compiled steps).
        self.replace_bad = replace_bad
        self.transform = transform
        self.shape = (im_size, im_size, 3)
        self.seed = seed
        # Batches allocated in pinned memory copy to a GPU asynchronously, with no
        # extra host copy (only set when CUDA is present). torch caches pinned blocks
        # itself, and knows when an asynchronous copy from one is done: no pool then.
        self.pin_memory = pin_memory
        self.pool = None if pin_memory else BufferPool()

    def __getstate__(self):
        # Worker processes allocate their batches in shared memory, not from a pool.
        return {**self.__dict__, "pool": None}

    def load_into(self, i: int, epoch: int, out: np.ndarray) -> tuple[str, str] | None:
        """Decodes image `i` into `out`, a writable uint8 (H, W, 3) array; returns
        None, or (path, error) if the file cannot be decoded (`out` is then left in
        any state)."""
        # `i` may be a repeat's virtual index (repeated augmentation): i + copy x N,
        # the same image with a seed of its own.
        rng = random.Random(image_seed(self.seed, epoch, i))
        j = i % len(self.index)
        image = None
        try:
            image = EncodedImage(self.index.read(j))
            self.transform(image, rng, out)
        except DECODE_ERRORS as e:
            return self.index.path(j), f"{type(e).__name__}: {e}"
        finally:
            if image is not None:
                image.close()
        return None

    def decode(self, i: int, epoch: int, out: np.ndarray) -> tuple[int, list]:
        """Decodes image `i` into `out` (writable uint8 (H, W, 3)); returns (the index
        whose image `out` now holds, or -1 for none, [(path, error)] of the bad images
        met). With `replace_bad`, a bad image's place goes to images drawn from
        (seed, epoch, i), the same draws in every mode and run, each decoded under a
        virtual index of its own (so with a crop of its own); -1 only if
        MAX_REPLACEMENTS draws in a row are bad too."""
        bad = self.load_into(i, epoch, out)
        if bad is None:
            return i, []
        found = [bad]
        if self.replace_bad:
            draws = random.Random(f"replace-{image_seed(self.seed, epoch, i)}")
            n = len(self.index)
            for attempt in range(MAX_REPLACEMENTS):
                j = draws.randrange(n) + n * (REPLACEMENT_COPY + attempt)
                bad = self.load_into(j, epoch, out)
                if bad is None:
                    return j, found
                found.append(bad)
        return -1, found

    def label(self, i: int) -> int:
        """The label of image `i` (a repeat's virtual index included)."""
        return int(self.index.labels[i % len(self.index)])

    def load(self, i: int, epoch: int) -> tuple[np.ndarray | None, int, list]:
        """(image `i`, or its replacement, as a new uint8 (H, W, 3) array or None;
        its label; the bad images met): `decode` into a fresh array."""
        out = np.empty(self.shape, dtype=np.uint8)
        used, bad = self.decode(i, epoch, out)
        return (out, self.label(used), bad) if used >= 0 else (None, -1, bad)

    def new_batch(self, indices: Sequence[int] | np.ndarray) -> "PartialBatch":
        """Returns an empty PartialBatch for `indices` (int array), to be filled."""
        # A copy: rows of replaced images change their index, the plan stays.
        return PartialBatch(self, np.array(indices, dtype=np.int64))

    def load_batch(self, indices: Sequence[int] | np.ndarray, epoch: int) -> Batch:
        """Decodes `indices` (int array) into one Batch, skipping bad images."""
        part = self.new_batch(indices)
        part.fill(0, len(indices), epoch)
        return part.finish()


class PartialBatch:
    """A batch being decoded, possibly by several threads at once (disjoint rows).

    Images are written straight into one (B, H, W, 3) uint8 buffer, from the decoder's
    pool, or in pinned memory when the decoder asks for it. The buffer is allocated
    when the first rows start decoding, not when the batch is queued: batches waiting
    behind the running ones hold no memory.
    """

    def __init__(self, decoder: ImageDecoder, indices: np.ndarray) -> None:
        self.decoder = decoder
        self.indices = indices
        self._images = None
        self._lock = threading.Lock()
        self.ok = np.ones(len(indices), dtype=bool)
        self.bad = []
        self.chunks_done = 0  # Counted by the (single) consumer of finished chunks.

    @property
    def images(self) -> torch.Tensor:
        """The batch's uint8 (B, H, W, 3) tensor, allocated on first use."""
        if self._images is None:
            with self._lock:  # Two chunks of one batch may start at once.
                if self._images is None:
                    self._images = self._allocate()
        return self._images

    def _allocate(self):
        shape = (len(self.indices), *self.decoder.shape)
        if self.decoder.pool is not None:
            return torch.from_numpy(self.decoder.pool.get(shape))
        return torch.empty(shape, dtype=torch.uint8, pin_memory=self.decoder.pin_memory)

    def fill(self, start: int, stop: int, epoch: int) -> "PartialBatch":
        """Decodes rows `start` to `stop` (exclusive) of the batch; returns self."""
        buf = self.images.numpy()
        for row in range(start, stop):
            used, bad = self.decoder.decode(self.indices[row], epoch, buf[row])
            if bad:
                self.bad.extend(bad)  # list.extend is atomic: safe across threads.
                self.ok[row] = used >= 0
                self.indices[row] = used  # the label follows the replacement
        return self

    def finish(self) -> Batch:
        """Returns the Batch of the decoded rows, without the bad ones."""
        index = self.decoder.index
        labels = index.labels[self.indices % len(index)]
        if self.ok.all():
            return make_batch(self.images, labels, self.bad)
        # Compacted in place, so that the batch stays in its buffer (the pool's, or
        # the slot that 'subprocess' mode hands to the training process); by numpy
        # (one thread): torch's indexing would start intra-op threads in whichever
        # thread assembles the batch.
        buf, count = self.images.numpy(), int(self.ok.sum())
        buf[:count] = buf[self.ok]
        return make_batch(self.images[:count], labels[self.ok], self.bad)


def make_batch(
    images_nhwc: np.ndarray | torch.Tensor,
    labels: np.ndarray | Sequence[int],
    bad: list[tuple[str, str]],
) -> Batch:
    """Wraps a uint8 (B, H, W, 3) array or tensor and labels into a Batch (no copy)."""
    images = torch.as_tensor(images_nhwc).permute(0, 3, 1, 2)
    return Batch(images, torch.from_numpy(np.asarray(labels, dtype=np.int64)), bad)
