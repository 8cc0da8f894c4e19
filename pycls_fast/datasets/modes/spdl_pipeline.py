"""'spdl' mode: an spdl.pipeline of chunk-level tasks inside the training process.

    source (chunks of CHUNK_IMAGES rows of a batch)
      -> decode_chunk (NUM_WORKERS threads, writes rows into the batch's buffer)
      -> assemble (event loop: emits a batch when its last chunk is done) -> sink

A task decodes a chunk of images, not one image: the per-image Python glue is then a
short loop in the worker thread and the pipeline's event loop handles one item per
chunk. On few cores that glue, not the decoding, bounds an image-level pipeline (see
docs/PERFORMANCE.md). Chunks rather than whole batches keep few batches in flight
(memory) and the threads busy until the end of an epoch. Pillow releases the GIL while
decoding, so the threads run in parallel. `output_order="input"` keeps the source
order, so batches come out in order and runs are reproducible.

The default 'threads' mode (threaded.py) runs the same tasks on a plain thread pool
scheduled by the consumer, which measured faster on few cores (docs/PERFORMANCE.md);
this pipeline stays selectable, and is a comparison row of benchmarks/loader.py.
"""

from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from spdl.pipeline import AsyncQueue, PipelineBuilder, PipelineFailure

from pycls_fast.datasets.modes.batch import Batch, ImageDecoder

# Tens of milliseconds of work per task at 224 px: spdl's per-task cost stays small.
CHUNK_IMAGES = 16
# Tasks queued per decoding thread. More than one, so that a thread that finishes a
# chunk starts the next at once instead of idling until the event loop thread (which
# needs the GIL) hands it one.
TASKS_PER_THREAD = 2


def iterate_spdl(
    decoder: ImageDecoder,
    batches: Iterable[np.ndarray],
    epoch: int,
    num_threads: int,
    prefetch: int,
    stats_interval: float = 0,
    chunk_images: int = CHUNK_IMAGES,
    tasks_per_thread: int = TASKS_PER_THREAD,
) -> Iterator[Batch]:
    """Yields one Batch per index array of `batches`, in order.

    `decoder`: an ImageDecoder; `num_threads`: decoding threads (>= 1); `prefetch`:
    finished batches buffered ahead of the consumer, minus one (about `prefetch`
    batches are decoded or being decoded ahead, as with the DataLoader's
    prefetch_factor x workers). `stats_interval` > 0: spdl logs each stage's task time
    and each queue's throughput (items: chunks, then batches) and occupancy every that
    many seconds, at INFO on logger `spdl.pipeline`; 0: no stats hooks at all. An
    exception raised while decoding stops the pipeline and is raised here (a bad image
    is not one: it is skipped and listed in Batch.bad).
    """

    def chunks():
        for indices in batches:
            part = decoder.new_batch(indices)
            for start in range(0, len(indices), chunk_images):
                yield part, start, min(start + chunk_images, len(indices))

    def decode_chunk(chunk):
        part, start, stop = chunk
        return part.fill(start, stop, epoch)

    async def assemble(part):
        # Chunks arrive in source order, so a batch is complete at its last chunk.
        part.chunks_done += 1
        if part.chunks_done * chunk_images >= len(part.indices):
            yield part.finish()

    stats = stats_interval > 0
    executor = ThreadPoolExecutor(num_threads, thread_name_prefix="decode")
    pipeline = (
        PipelineBuilder()
        .add_source(chunks())
        .pipe(
            decode_chunk,
            concurrency=num_threads * tasks_per_thread,
            executor=executor,
            output_order="input",
            max_failures=0,
        )
        .pipe(assemble, max_failures=0)
        .add_sink(max(1, prefetch - 1))
        .build(
            num_threads=1,
            report_stats_interval=stats_interval if stats else -1,
            queue_class=None if stats else AsyncQueue,
            task_hook_factory=None if stats else (lambda info: []),
        )
    )
    try:
        with pipeline.auto_stop():
            yield from pipeline
    except PipelineFailure as e:
        raise _root_cause(e) from None
    finally:
        executor.shutdown(wait=True, cancel_futures=True)


def _root_cause(error):
    """The exception a task raised, out of spdl's failure group and its wrappers."""
    while True:
        if getattr(error, "exceptions", None):
            error = error.exceptions[0]
        elif error.__cause__ is not None:
            error = error.__cause__
        else:
            return error
