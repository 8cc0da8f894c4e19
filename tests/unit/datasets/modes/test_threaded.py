"""The thread engines (plain threads and spdl): chunk assembly, order, errors."""

import time

import numpy as np
import pytest
import torch

from pycls_fast.datasets.formats.index import scan_split
from pycls_fast.datasets.formats.synthetic import make_image_folder
from pycls_fast.datasets.images.transforms import TrainTransform
from pycls_fast.datasets.modes.batch import BufferPool, ImageDecoder
from pycls_fast.datasets.modes.spdl_pipeline import CHUNK_IMAGES, iterate_spdl
from pycls_fast.datasets.modes.threaded import chunks_per_batch, iterate_threaded


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("threaded"))
    make_image_folder(
        root, splits=("train",), num_classes=2, images_per_class=40, size=(40, 32)
    )
    return scan_split(root + "/train")


ENGINES = [iterate_threaded, iterate_spdl]


def test_chunks_per_batch():
    assert chunks_per_batch(2, 4) == 2  # One chunk per thread: 8 tasks in flight
    assert chunks_per_batch(8, 4) == 8
    assert chunks_per_batch(3, 2) == 3
    assert chunks_per_batch(4, 1) == 8  # PREFETCH 1: still 2 tasks per thread
    assert chunks_per_batch(1, 0) == 2


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("threads,prefetch", [(3, 2), (1, 1), (4, 8)])
def test_batches_in_order_and_equal_to_inline(index, engine, threads, prefetch):
    decoder = ImageDecoder(index, TrainTransform(16), 16, seed=3)
    # Sizes around the chunk sizes: a partial chunk, exactly one, several, one image.
    sizes = [CHUNK_IMAGES + 1, CHUNK_IMAGES, 2 * CHUNK_IMAGES + 3, 1, 5]
    order = np.random.default_rng(0).permutation(len(index))
    batches = np.split(order[: sum(sizes)], np.cumsum(sizes)[:-1])
    out = list(engine(decoder, batches, 1, threads, prefetch))
    assert [len(b.labels) for b in out] == sizes
    for batch, indices in zip(out, batches):
        ref = decoder.load_batch(indices, 1)
        assert torch.equal(batch.images, ref.images)
        assert batch.labels.tolist() == index.labels[indices].tolist()


@pytest.mark.parametrize("engine", ENGINES)
def test_transform_error_stops_and_surfaces(index, engine):
    class Broken(TrainTransform):
        def __call__(self, image, rng, out):
            raise RuntimeError("transform bug")

    decoder = ImageDecoder(index, Broken(16), 16, seed=0)
    with pytest.raises(BaseException, match="transform bug"):
        list(engine(decoder, [np.arange(4)], 0, num_threads=2, prefetch=2))


@pytest.mark.parametrize("engine", ENGINES)
def test_no_batches_yields_nothing(index, engine):
    decoder = ImageDecoder(index, TrainTransform(16), 16, seed=0)
    assert list(engine(decoder, [], 0, num_threads=2, prefetch=2)) == []


def test_prefetch_bounds_batches_in_flight_and_early_close_stops(index):
    decoder = ImageDecoder(index, TrainTransform(16), 16, seed=0)
    created = []
    new_batch = decoder.new_batch
    decoder.new_batch = lambda indices: created.append(1) or new_batch(indices)
    batches = [np.arange(i, i + 4) for i in range(0, 40, 4)]
    stream = iterate_threaded(decoder, batches, 0, num_threads=2, prefetch=3)
    next(stream)
    # The batch handed out plus 3 ahead, whatever the threads' speed.
    assert len(created) == 4
    stream.close()  # Cancels what is queued, waits for what runs: no more batches.
    assert len(created) == 4


def test_buffer_pool_reuses_only_buffers_nothing_refers_to():
    pool = BufferPool(keep=1)
    a = pool.get((2, 4, 4, 3))
    a[...] = 7
    images = torch.from_numpy(a).permute(0, 3, 1, 2)  # What a Batch holds.
    del a
    b = pool.get((2, 4, 4, 3))
    assert not np.shares_memory(b, images.numpy())  # Still in use: a new buffer.
    base = images.numpy()
    del images, base
    c = pool.get((2, 4, 4, 3))  # The first buffer, now free, comes back.
    assert (c == 7).all()
    assert pool.get((1, 4, 4, 3)).shape == (1, 4, 4, 3)  # Another shape: new.
    del b, c
    assert len(pool._idle) == 1  # At most `keep` idle buffers are kept.


def test_batches_queued_behind_the_running_ones_hold_no_buffer(index):
    class Slow(TrainTransform):
        def __call__(self, image, rng, out):
            time.sleep(0.002)  # Decoding slower than the consumer, as in a benchmark.
            super().__call__(image, rng, out)

    decoder = ImageDecoder(index, Slow(16), 16, seed=0)
    buffers = set()
    get = decoder.pool.get

    def counted_get(shape):
        view = get(shape)
        buffers.add(id(view.base))  # Pooled bases stay alive: ids are not reused.
        return view

    decoder.pool.get = counted_get
    batches = [np.arange(i, i + 4) for i in range(0, 80, 4)]
    for batch in iterate_threaded(decoder, batches, 0, num_threads=2, prefetch=6):
        del batch
    # The batch the threads decode together, the one the consumer holds, and one more
    # while the threads move on to the next; allocated at queueing time it would be 8.
    assert len(buffers) <= 3
