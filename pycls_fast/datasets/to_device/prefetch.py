"""Device prefetch: batch i+1 is copied and prepared on the GPU while step i runs.

    batches = DevicePrefetcher(loader, prepare)   # prepare: a DeviceBatchTransform
    batches.set_epoch(epoch)
    for inputs, targets in batches:               # on prepare.device, ready to use
        ...

On CUDA the host-to-device copy (from pinned memory, non-blocking) and the device
transform of the next batch are queued on a side stream before the current batch is
handed out; the consumer's stream waits for the side stream before using a batch.
Elsewhere it is a pass-through: exactly `prepare(images, labels)` per batch, in order.
An empty batch (every image of it failed to decode) is passed on as it came, so the
caller still sees `len(targets) == 0`.
"""

from collections.abc import Iterable, Iterator

import torch

from pycls_fast.datasets.to_device.transform import DeviceBatchTransform


def uses_side_stream(device: torch.device | str) -> bool:
    """Whether batches for `device` are prepared on a side CUDA stream."""
    return torch.device(device).type == "cuda"


class DevicePrefetcher:
    """Wraps a loader of host (images, labels) batches and a DeviceBatchTransform;
    iterating yields the transform's (inputs, targets) on its device. `len`,
    `set_epoch` and `stats` are the loader's."""

    def __init__(self, loader: Iterable, transform: DeviceBatchTransform) -> None:
        self.loader = loader
        self.transform = transform
        self.device = torch.device(transform.device)
        # The transform's random state as of the batch last handed out: the batch
        # queued ahead has drawn from it already, and a checkpoint taken after the
        # current step must not include that draw (exact resume).
        self._handed_state: dict | None = None

    def __len__(self) -> int:
        return len(self.loader)

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        self.loader.set_epoch(epoch, start_batch=start_batch)

    def stats(self) -> dict:
        return self.loader.stats()

    def state_dict(self) -> dict:
        """The transform's random state after the batches handed out so far (a
        Stateful of the checkpoint, in place of the transform's own)."""
        if self._handed_state is not None:
            return self._handed_state
        return self.transform.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.transform.load_state_dict(state)
        self._handed_state = None

    def __iter__(self) -> Iterator:
        if uses_side_stream(self.device):
            return self._iter_side_stream()
        return self._iter_in_order()

    def _prepare(self, images, labels):
        if not len(labels):
            return images, labels
        return self.transform(images, labels)

    def _iter_in_order(self):
        for images, labels in self.loader:
            yield self._prepare(images, labels)

    def _iter_side_stream(self):
        # GPU only: stream semantics from torch/cuda/streams.py (wait_stream) and
        # Tensor.record_stream (torch/_tensor.py, _tensor_docs.py).
        side = torch.cuda.Stream(self.device)
        batches = iter(self.loader)
        self._handed_state = None
        ahead = self._queue_next(batches, side)
        while ahead is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_stream(side)
            for t in ahead:
                if isinstance(t, torch.Tensor) and t.device.type == "cuda":
                    # Allocated on `side`, used and freed on `current`: the caching
                    # allocator must not hand the memory back to `side` before
                    # `current` is done with it.
                    t.record_stream(current)
            handed = self.transform.state_dict()  # host-side: no device sync
            ready, ahead = ahead, self._queue_next(batches, side)
            self._handed_state = handed
            yield ready
        self._handed_state = None

    def _queue_next(self, batches, side):
        """Queues the copy and transform of the next batch on `side`; None at the
        end of the loader."""
        try:
            images, labels = next(batches)
        except StopIteration:
            return None
        with torch.cuda.stream(side):
            return self._prepare(images, labels)
