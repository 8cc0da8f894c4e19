"""'threads' mode: decoding threads inside the training process, batches in order.

    consumer thread: submits the tasks of `prefetch` batches ahead, then for each batch
      waits for its tasks, yields it and submits the next batch's tasks
    `num_threads` decoding threads: one task = a chunk of rows of one batch, decoded
      and written straight into the batch's buffer (allocated when the first chunk
      starts)

Pillow and torch release the GIL while they decode and resize, so the threads run in
parallel; only the per-image Python glue is serialized.
There is no scheduler thread: an spdl.pipeline of the same chunk tasks
(`DATA_LOADER.MODE spdl`, datasets/modes/spdl_pipeline.py) keeps the cores less
busy, its event loop thread competing with the decoding threads for the GIL and the
cores (docs/PERFORMANCE.md, "Data loader"). Each batch
is split into one chunk per thread, so the threads decode one batch together: few
batches hold a buffer at once, where a DataLoader keeps workers x prefetch_factor
batches in the making.
"""

import collections
import logging
import math
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from pycls_fast.datasets.modes.batch import Batch, ImageDecoder

logger = logging.getLogger(__name__)

# Tasks kept queued or running per decoding thread (when `prefetch` batches allow), so
# that a thread finishing a task starts the next at once.
TASKS_PER_THREAD = 2


def chunks_per_batch(
    num_threads: int, prefetch: int, tasks_per_thread: int = TASKS_PER_THREAD
) -> int:
    """How many tasks each batch is split into: one per thread (the threads then work
    on the same batch, and the batches behind it need no buffer yet), or more if the
    `prefetch` batches in flight would otherwise hold fewer than `tasks_per_thread`
    tasks per thread."""
    return max(
        num_threads, math.ceil(num_threads * tasks_per_thread / max(1, prefetch))
    )


class _Stats:
    """Decoding task times and ready-batch occupancy, logged every `period` seconds."""

    def __init__(self, period, num_threads, prefetch):
        self.period, self.num_threads, self.prefetch = period, num_threads, prefetch
        self.lock = threading.Lock()
        self._reset(time.perf_counter())

    def _reset(self, now):
        self.start, self.tasks, self.images, self.task_s = now, 0, 0, 0.0
        self.batches, self.ready = 0, 0

    def task_done(self, images, seconds):
        with self.lock:
            self.tasks, self.images = self.tasks + 1, self.images + images
            self.task_s += seconds

    def batch_taken(self, ready):
        """Called by the consumer for each batch; `ready`: finished batches waiting."""
        self.batches, self.ready = self.batches + 1, self.ready + ready
        now = time.perf_counter()
        if now - self.start < self.period:
            return
        with self.lock:
            wall = now - self.start
            logger.info(
                "decode: %d tasks, %.0f img/s, %.1f ms/task, %.2f of %d threads busy; "
                "ready batches: %.2f of %d on average; consumer: %.1f batches/s",
                self.tasks,
                self.images / wall,
                1000 * self.task_s / max(1, self.tasks),
                self.task_s / wall,
                self.num_threads,
                self.ready / max(1, self.batches),
                self.prefetch,
                self.batches / wall,
            )
            self._reset(now)


def iterate_threaded(
    decoder: ImageDecoder,
    batches: Iterable[np.ndarray],
    epoch: int,
    num_threads: int,
    prefetch: int,
    stats_period: float = 0,
) -> Iterator[Batch]:
    """Yields one Batch per index array of `batches`, in order.

    `decoder`: an ImageDecoder; `num_threads`: decoding threads (>= 1); `prefetch`:
    batches decoded or being decoded ahead of the consumer (as the DataLoader's
    prefetch_factor x workers). `stats_period` > 0: log the decoding throughput, task
    time, busy threads and ready-batch occupancy every that many seconds, at INFO on
    logger `pycls_fast.datasets.modes.threaded`. An exception raised while decoding is
    raised here (a bad image is not one: it is skipped and listed in Batch.bad);
    closing the generator early cancels the queued tasks and waits for the running
    ones.
    """
    prefetch = max(1, prefetch)
    parts = chunks_per_batch(num_threads, prefetch)
    stats = _Stats(stats_period, num_threads, prefetch) if stats_period > 0 else None

    def fill(part, start, stop):
        t0 = time.perf_counter()
        part.fill(start, stop, epoch)
        if stats is not None:
            stats.task_done(stop - start, time.perf_counter() - t0)

    executor = ThreadPoolExecutor(num_threads, thread_name_prefix="decode")
    pending = collections.deque()
    todo = iter(batches)

    def submit_next():
        indices = next(todo, None)
        if indices is None:
            return
        part = decoder.new_batch(indices)
        size = math.ceil(len(indices) / parts) if len(indices) else 1
        tasks = [
            executor.submit(fill, part, start, min(start + size, len(indices)))
            for start in range(0, len(indices), size)
        ]
        pending.append((part, tasks))

    try:
        for _ in range(prefetch):
            submit_next()
        while pending:
            part, tasks = pending.popleft()
            for task in tasks:
                task.result()
            submit_next()
            if stats is not None:
                stats.batch_taken(sum(all(t.done() for t in ts) for _, ts in pending))
            yield part.finish()
    finally:
        executor.shutdown(wait=True, cancel_futures=True)
