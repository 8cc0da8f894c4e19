"""'threads' mode: an spdl.pipeline of batch-level tasks inside the training process.

    source (index arrays, one per batch) -> decode_batch (NUM_WORKERS threads) -> sink

One task decodes a whole batch. The per-image Python glue is then a short loop in the
worker thread, and the pipeline's event loop handles one item per batch instead of one
per image: on few cores that glue, not the decoding, bounds an image-level pipeline
(see docs/PERFORMANCE.md). Pillow releases the GIL while decoding, so the threads run
in parallel. At most `prefetch` batches are decoded or being decoded ahead of the
consumer (as with the DataLoader's prefetch_factor x workers), and at least one per
thread plus one finished; `output_order="input"` keeps the source order, so runs are
reproducible.
"""

from spdl.pipeline import AsyncQueue, PipelineBuilder


def iterate_threaded(decoder, batches, epoch, num_threads, prefetch, stats_interval=0):
    """Yields one Batch per index array of `batches`, in order.

    `decoder`: an ImageDecoder; `num_threads`: decoding threads (>= 1); `prefetch`:
    batches decoded or in progress ahead of the consumer. `stats_interval` > 0: spdl
    logs each stage's task time and each queue's throughput (items are batches) and
    occupancy every that many seconds, at INFO on logger `spdl.pipeline`; 0: no stats
    hooks at all. An exception raised while decoding (a bad image is not one: it is
    skipped and listed in Batch.bad) stops the pipeline and is raised here.
    """

    def decode_batch(indices):
        return decoder.load_batch(indices, epoch)

    stats = stats_interval > 0
    pipeline = (
        PipelineBuilder()
        .add_source(batches)
        .pipe(
            decode_batch,
            concurrency=num_threads,
            output_order="input",
            max_failures=0,
        )
        .add_sink(max(1, prefetch - num_threads))
        .build(
            num_threads=num_threads,
            report_stats_interval=stats_interval if stats else -1,
            queue_class=None if stats else AsyncQueue,
            task_hook_factory=None if stats else (lambda info: []),
        )
    )
    with pipeline.auto_stop():
        yield from pipeline
