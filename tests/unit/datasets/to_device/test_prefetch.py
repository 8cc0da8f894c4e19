"""DevicePrefetcher: a pass-through on the CPU (same batches, same order, the
loader's len / set_epoch / stats); the side-stream path only for a CUDA device."""

import torch

from pycls_fast.config import get_cfg
from pycls_fast.datasets.to_device.prefetch import DevicePrefetcher, uses_side_stream
from pycls_fast.datasets.to_device.transform import DeviceBatchTransform


class _Loader:
    """A loader of seeded uint8 batches, with an empty batch in the middle."""

    def __init__(self):
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch, start_batch=0):
        self.epoch, self.start = epoch, start_batch

    def __len__(self):
        return 4 - self.start

    def stats(self):
        return {"images": 7}

    def __iter__(self):
        g = torch.Generator().manual_seed(self.epoch)
        for i in range(self.start, 4):
            b = 0 if i == 2 else 3
            images = torch.randint(0, 256, (b, 3, 8, 8), dtype=torch.uint8, generator=g)
            yield images, torch.arange(b) % 4


def _transform():
    cfg = get_cfg()
    cfg.MODEL.NUM_CLASSES = 4
    cfg.TRAIN.MIXUP_ALPHA = 0.2
    cfg.TRAIN.CUTMIX_ALPHA = 1.0
    return DeviceBatchTransform(cfg, "cpu")


def test_cpu_prefetch_yields_what_the_transform_yields():
    loader, plain = _Loader(), _transform()
    expected = [plain(x, y) if len(y) else (x, y) for x, y in loader]
    got = list(DevicePrefetcher(loader, _transform()))
    assert len(got) == len(expected) == 4
    for (gx, gy), (ex, ey) in zip(got, expected):
        assert torch.equal(gx, ex) and torch.equal(gy, ey)
    assert len(got[2][1]) == 0  # the empty batch is passed on as it came


def test_loader_interface_passes_through():
    loader = _Loader()
    batches = DevicePrefetcher(loader, _transform())
    batches.set_epoch(3, start_batch=1)
    assert (loader.epoch, loader.start) == (3, 1)
    assert len(batches) == 3 and batches.stats() == {"images": 7}


def test_side_stream_only_for_cuda(monkeypatch):
    assert uses_side_stream("cuda") and uses_side_stream(torch.device("cuda", 1))
    assert not uses_side_stream("cpu") and not uses_side_stream("meta")

    class _CudaTransform:
        device = torch.device("cuda", 0)

    batches = DevicePrefetcher(_Loader(), _CudaTransform())
    monkeypatch.setattr(batches, "_iter_side_stream", lambda: iter(["side"]))
    assert list(batches) == ["side"]  # chosen without touching CUDA here
    cpu = DevicePrefetcher(_Loader(), _transform())
    monkeypatch.setattr(cpu, "_iter_side_stream", lambda: iter(["side"]))
    assert len(list(cpu)) == 4
