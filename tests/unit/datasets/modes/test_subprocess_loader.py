"""'subprocess' mode: batches as 'threads' makes them, from child processes, through
slots of shared memory; its children's errors, deaths and lifetime."""

import copy
import logging
import os
import signal
import time

import numpy as np
import pytest
import torch

from pycls_fast.datasets.formats.synthetic import make_image_folder
from pycls_fast.datasets.loader import construct_train_loader
from pycls_fast.datasets.modes import subprocess_loader
from pycls_fast.errors import LoaderProcessError, error_line
from tests.helpers import loader_cfg, one_epoch, shm_held

NUM_CLASSES, PER_CLASS = 3, 6  # 18 images


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("imagenet"))
    return make_image_folder(
        root, num_classes=NUM_CLASSES, images_per_class=PER_CLASS, size=(48, 40)
    )


def _loader(root, tmp_path, **over):
    cfg = loader_cfg(root, tmp_path, NUM_CLASSES, DATA_LOADER__MODE="subprocess")
    for key, value in over.items():
        node, name = key.split("__")
        cfg[node][name] = value
    return construct_train_loader(cfg)


def _equal(a, b):
    return len(a) == len(b) and all(
        torch.equal(x, p) and torch.equal(y, q) for (x, y), (p, q) in zip(a, b)
    )


class RaisingTransform:
    """A train transform with a bug (not a bad image)."""

    def __call__(self, image, rng, out):
        raise RuntimeError("transform bug on purpose")


class SlowTransform:
    """The train transform `inner`, `seconds` slower per image: the same pixels."""

    def __init__(self, inner, seconds):
        self.inner, self.seconds = inner, seconds

    def __call__(self, image, rng, out):
        time.sleep(self.seconds)
        return self.inner(image, rng, out)


def test_two_processes_yield_the_threads_batches_resume_and_epochs(data_root, tmp_path):
    reference = construct_train_loader(loader_cfg(data_root, tmp_path, NUM_CLASSES))
    loader = _loader(data_root, tmp_path, DATA_LOADER__SUBPROCESSES=2)
    for epoch in (0, 3):
        assert _equal(one_epoch(loader, epoch), one_epoch(reference, epoch))
    children = loader._subprocess_loader.children
    assert len(children) == 2 and len({c.pid for c in children}) == 2
    # Resuming mid-epoch: the epoch's remaining batches, the same ones.
    full = one_epoch(reference, 4)
    loader.set_epoch(4, start_batch=1)
    rest = [(x.clone(), y.clone()) for x, y in loader]
    assert _equal(rest, full[1:])
    # The same child processes served every epoch.
    assert loader._subprocess_loader.children == children
    loader.close()
    assert all(c.process.poll() is not None for c in children)


def test_batches_kept_by_the_consumer_stay_intact(data_root, tmp_path):
    loader = _loader(data_root, tmp_path, DATA_LOADER__PREFETCH=1)
    reference = one_epoch(loader, 0)
    # Two epochs' batches held at once (8 batches, more than the slots made at
    # first): no slot is handed back while a batch uses it.
    loader.set_epoch(0)
    first = list(loader)
    loader.set_epoch(0)
    second = list(loader)
    assert _equal(first, reference) and _equal(second, reference)
    views = [x for x, _ in first + second]
    assert len({x.untyped_storage().data_ptr() for x in views}) == len(views)
    loader.close()


def test_an_abandoned_epoch_leaves_the_next_intact(data_root, tmp_path):
    loader = _loader(data_root, tmp_path)
    reference = one_epoch(loader, 2)
    loader.set_epoch(1)
    batches = iter(loader)
    next(batches)
    batches.close()  # the consumer leaves epoch 1 after one batch
    assert _equal(one_epoch(loader, 2), reference)
    loader.close()


@pytest.mark.timeout(60)  # a slot leak shows as a hang in the last epoch
def test_epochs_abandoned_mid_decoding_give_every_slot_back(data_root, tmp_path):
    reference = construct_train_loader(loader_cfg(data_root, tmp_path, NUM_CLASSES))
    loader = _loader(data_root, tmp_path)
    # Slow images: when the consumer leaves, the batch after the one it took is
    # still being decoded into a slot (or finished but not yet sent).
    loader.decoder.transform = SlowTransform(loader.decoder.transform, 0.05)
    # More abandoned epochs than the child has slots (PREFETCH 4: 8 at first).
    for epoch in range(12):
        loader.set_epoch(epoch)
        batches = iter(loader)
        next(batches)
        batches.close()  # as precise BN statistics, or a `break` out of the loop
    child = loader._subprocess_loader.children[0]
    assert len(child.slots) < 12  # every epoch's slots were used again
    assert _equal(one_epoch(loader, 5), one_epoch(reference, 5))
    loader.close()


def test_a_batch_awaited_long_is_reported(data_root, tmp_path, caplog, monkeypatch):
    loader = _loader(data_root, tmp_path, DATA_LOADER__PREFETCH=1)
    one_epoch(loader, 0)  # the child started
    # A new decoder, sent to the child with the next epoch: slow images.
    loader.decoder = copy.copy(loader.decoder)
    loader.decoder.transform = SlowTransform(loader.decoder.transform, 0.2)
    monkeypatch.setattr(subprocess_loader, "STALL_WARNING_S", 0.1)
    loader.set_epoch(0)
    batches = iter(loader)
    with caplog.at_level(logging.WARNING):
        next(batches)
    batches.close()
    pid = loader._subprocess_loader.children[0].pid
    assert f"no batch from the loader subprocess (pid {pid}) for" in caplog.text
    loader.close()


def test_image_size_change_between_epochs(data_root, tmp_path):
    # TRAIN.SIZE_SCHEDULE: epoch 1 decodes at 24 px in batches of 2, then 32 px / 4.
    over = {"TRAIN__SIZE_SCHEDULE": [[0, 24, 2], [1, 32, 4]]}
    loader = _loader(data_root, tmp_path, **over)
    reference = construct_train_loader(
        loader_cfg(data_root, tmp_path, NUM_CLASSES, **over)
    )
    for epoch in (0, 1, 0):
        got = one_epoch(loader, epoch)
        assert _equal(got, one_epoch(reference, epoch))
        assert got[0][0].shape[-1] == (24 if epoch == 0 else 32)
    loader.close()


def test_an_error_in_the_child_is_one_line(data_root, tmp_path):
    loader = _loader(data_root, tmp_path)
    loader.decoder.transform = RaisingTransform()  # pickled to the child
    with pytest.raises(LoaderProcessError) as raised:
        one_epoch(loader, 0)
    line = error_line(raised.value)
    assert line == "error: loader subprocess: RuntimeError: transform bug on purpose"
    loader.close()


def test_a_killed_child_is_reported(data_root, tmp_path):
    loader = _loader(data_root, tmp_path)
    one_epoch(loader, 0)
    child = loader._subprocess_loader.children[0]
    os.kill(child.pid, signal.SIGKILL)
    with pytest.raises(LoaderProcessError, match=rf"\(pid {child.pid}\) was killed"):
        one_epoch(loader, 1)
    loader.close()


def test_the_child_ignores_stop_signals_and_leaves_with_its_parent(data_root, tmp_path):
    loader = _loader(data_root, tmp_path)
    reference = one_epoch(loader, 0)
    child = loader._subprocess_loader.children[0]
    # SIGINT (Ctrl-C reaches the whole process group) and SIGTERM are the training
    # process's to handle: the child keeps serving the batches a checkpoint needs.
    os.kill(child.pid, signal.SIGINT)
    os.kill(child.pid, signal.SIGTERM)
    time.sleep(0.2)
    assert _equal(one_epoch(loader, 0), reference)
    # Its socket closed, as when the training process dies, the child ends.
    child.sock.close()
    assert child.process.wait(timeout=10) == 0
    loader.close()


def test_the_childs_logs_reach_this_process(data_root, tmp_path, caplog):
    loader = _loader(data_root, tmp_path, DATA_LOADER__STATS_PERIOD=1e-9)
    with caplog.at_level(logging.INFO):
        one_epoch(loader, 0)
    lines = [r.getMessage() for r in caplog.records if r.name.endswith("threaded")]
    assert len(lines) == 4 and all("threads busy" in line for line in lines)
    assert "loader subprocess 1 of 1 started" in caplog.text
    loader.close()


def test_slots_are_not_files(data_root, tmp_path):
    before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    loader = _loader(data_root, tmp_path)
    batches = one_epoch(loader, 0)
    pid = loader._subprocess_loader.children[0].pid
    with open(f"/proc/{pid}/maps") as f:
        assert "memfd:pycls_fast-batch" in f.read()
    after = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    # New entries may be other tests' (make test runs two files at once): none is
    # this process's or its loader's.
    assert not (after - before) & shm_held([os.getpid(), pid])
    assert np.all([len(y) == 4 for _, y in batches])
    loader.close()
