"""The threaded engine: chunk assembly, order, errors."""

import numpy as np
import pytest
import torch

from pycls_fast.datasets.batch import ImageDecoder
from pycls_fast.datasets.index import scan_split
from pycls_fast.datasets.synthetic import make_image_folder
from pycls_fast.datasets.threaded import CHUNK_IMAGES, iterate_threaded
from pycls_fast.datasets.transforms import TrainTransform


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("threaded"))
    make_image_folder(
        root, splits=("train",), num_classes=2, images_per_class=40, size=(40, 32)
    )
    return scan_split(root + "/train")


def test_batches_in_order_and_equal_to_inline(index):
    decoder = ImageDecoder(index, TrainTransform(16), 16, seed=3)
    # Sizes around the chunk size: a partial chunk, exactly one, several, one image.
    sizes = [CHUNK_IMAGES + 1, CHUNK_IMAGES, 2 * CHUNK_IMAGES + 3, 1]
    order = np.random.default_rng(0).permutation(len(index))
    batches = np.split(order[: sum(sizes)], np.cumsum(sizes)[:-1])
    out = list(iterate_threaded(decoder, batches, epoch=1, num_threads=3, prefetch=2))
    assert [len(b.labels) for b in out] == sizes
    for batch, indices in zip(out, batches):
        ref = decoder.load_batch(indices, 1)
        assert torch.equal(batch.images, ref.images)
        assert batch.labels.tolist() == index.labels[indices].tolist()


def test_transform_error_stops_and_surfaces(index):
    class Broken(TrainTransform):
        def __call__(self, im, rng):
            raise RuntimeError("transform bug")

    decoder = ImageDecoder(index, Broken(16), 16, seed=0)
    with pytest.raises(BaseException, match="transform bug"):
        list(iterate_threaded(decoder, [np.arange(4)], 0, num_threads=2, prefetch=2))


def test_no_batches_yields_nothing(index):
    decoder = ImageDecoder(index, TrainTransform(16), 16, seed=0)
    assert list(iterate_threaded(decoder, [], 0, num_threads=2, prefetch=2)) == []
