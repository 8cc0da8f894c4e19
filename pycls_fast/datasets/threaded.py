"""'threads' mode: an spdl.pipeline of batch-level tasks inside the training process.

    source (index arrays, one per batch) -> decode (NUM_WORKERS threads) -> sink

One task decodes a whole batch. The per-image Python glue is then a short loop in the
worker thread, and the pipeline's event loop handles one item per batch instead of one
per image: on few cores that glue, not the decoding, bounds an image-level pipeline
(see docs/PERFORMANCE.md). Pillow releases the GIL while decoding, so the threads run
in parallel.
The sink buffers PREFETCH decoded batches; with `output_order="input"` batches come out
in the order of the source, so runs are reproducible.
"""

import logging

from spdl.pipeline import PipelineBuilder

logger = logging.getLogger(__name__)


def iterate_threaded(decoder, batches, epoch, num_threads, prefetch, stats_interval=0):
    """Yields one Batch per index array of `batches`, in order.

    `decoder`: an ImageDecoder; `num_threads`: decoding threads (>= 1); `prefetch`:
    decoded batches buffered ahead of the consumer; `stats_interval` > 0: log per-stage
    task time and queue occupancy every that many seconds (spdl's stats hooks, logger
    `spdl.pipeline`). Exceptions raised while decoding (other than a bad image, which
    is skipped and reported in Batch.bad) stop the pipeline and are raised here.
    """

    def decode(indices):
        return decoder.load_batch(indices, epoch)

    pipeline = (
        PipelineBuilder()
        .add_source(batches)
        .pipe(
            decode,
            concurrency=num_threads,
            name="decode_batch",
            output_order="input",
            max_failures=0,
        )
        .add_sink(prefetch)
        .build(
            num_threads=num_threads,
            report_stats_interval=stats_interval if stats_interval > 0 else -1,
        )
    )
    with pipeline.auto_stop():
        yield from pipeline
