"""Loader constructors: `construct_train_loader(cfg)` and `construct_test_loader(cfg)`.

A loader yields `(images, labels)` for this process's rank: images uint8 (B, 3, H, W)
(channels-last in memory), labels int64 (B,). Normalization, PCA lighting, mixup /
cutmix and label smoothing run on the device: datasets/to_device/transform.py.

    loader = construct_train_loader(cfg)
    for epoch in range(start, cfg.OPTIM.MAX_EPOCH):
        loader.set_epoch(epoch)
        for images, labels in loader:   # len(loader) batches
            ...
        stats = loader.stats()          # data_wait_frac, img_per_s, bad_images, ...

DATA.FORMAT 'folder' reads `<split>/<class>/<image>` files (formats/index.py),
'shards' tar shards (formats/shards.py); both feed the same decoder and engines.

`loader.with_plan(batches, mode)` is the same loader on a fixed list of batches (every
epoch) in another DATA_LOADER.MODE: benchmarks and tests compare modes with it.
"""

import logging
import os
import time
import weakref
from collections.abc import Sequence

import numpy as np
import torch

from pycls_fast.config import train_stage
from pycls_fast.datasets.formats.index import check_split, load_index
from pycls_fast.datasets.formats.shards import check_shard_split, load_shard_index
from pycls_fast.datasets.images.transforms import build_transform
from pycls_fast.datasets.modes import sharding
from pycls_fast.datasets.modes.batch import ImageDecoder
from pycls_fast.datasets.modes.processes import iterate_processes
from pycls_fast.datasets.modes.spdl_pipeline import iterate_spdl
from pycls_fast.datasets.modes.subprocess_loader import SubprocessLoader
from pycls_fast.datasets.modes.threaded import iterate_threaded
from pycls_fast.errors import BadImagesError, ConfigError, UserError
from pycls_fast.storage import is_remote

logger = logging.getLogger(__name__)

# The values of DATA_LOADER.MODE that name an engine ('auto' names one of them).
MODES = ("threads", "spdl", "processes", "subprocess")

# DATA_LOADER.MODE 'auto' by the device the step runs on, from benchmarks/contention.py
# and benchmarks/real_run.py (docs/PERFORMANCE.md, "The loader beside the step"). On a
# GPU the training thread launches kernels and is host-bound: decoding threads in its
# process take its GIL in every launch, a child process does not. On a CPU the step is
# compute in GIL-free kernels sharing the same cores; a child process only adds a copy
# through shared memory and a second interpreter.
MEASURED_BEST_MODE = {"cuda": "subprocess", "cpu": "threads"}


def resolve_mode(mode: str, device_type: str) -> str:
    """The engine DATA_LOADER.MODE `mode` stands for when the step runs on a
    `device_type` device: `mode` itself, or for 'auto' the measured best (threads
    where nothing was measured)."""
    if mode == "auto":
        return MEASURED_BEST_MODE.get(device_type, "threads")
    return mode


class ImageLoader:
    """Iterable of (images, labels) batches of one rank, one epoch per iteration.

    `plan(epoch)` returns the epoch's batches as index arrays; `mode` is 'threads',
    'spdl', 'processes' or 'subprocess' (`subprocesses` child processes, started at
    the first epoch and ended by `close`, or when the loader is collected or the
    process exits). A bad image is skipped (its batch is one smaller; or another
    image takes its place: the decoder's `replace_bad`), logged with its path and
    counted; more than `max_bad_frac` of the epoch's images aborts
    the epoch with BadImagesError. A batch whose images all fail is yielded empty
    (B = 0), so that every rank yields one batch per planned batch; with `drop_empty`
    it is not yielded (evaluation, where an empty batch would only turn the metrics
    into NaN).
    """

    def __init__(
        self,
        decoder,
        plan,
        mode,
        num_workers,
        prefetch,
        max_bad_frac,
        stats_period=0,
        drop_empty=False,
        decoder_for=None,
        subprocesses=1,
    ):
        # `decoder_for(epoch)`: the decoder of that epoch (a TRAIN.SIZE_SCHEDULE
        # stage's image size), or None: `decoder` throughout.
        self.decoder_for = decoder_for
        self.decoder = decoder
        self.plan = plan
        self.mode = mode
        self.num_workers = num_workers
        self.prefetch = prefetch
        self.max_bad_frac = max_bad_frac
        self.stats_period = stats_period
        self.drop_empty = drop_empty
        self.subprocesses = subprocesses
        self._subprocess_loader = None
        self.epoch = 0
        self.start_batch = 0
        self.bad_images = []
        self._stats = {}

    def with_plan(
        self, batches: Sequence[np.ndarray], mode: str | None = None
    ) -> "ImageLoader":
        """A new loader over the same images and transforms (it shares this one's
        decoder) that yields `batches`, index arrays into the image index, in that
        order every epoch, in `mode` (default: this loader's). This loader is left as
        it was. For comparing modes, or timing a loader, on one fixed batch plan."""
        if mode is None:
            mode = self.mode
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        fixed = [np.asarray(b, dtype=np.int64) for b in batches]
        num_images = len(self.decoder.index)
        for b in fixed:
            if b.ndim != 1 or (b.size and (b.min() < 0 or b.max() >= num_images)):
                raise ValueError(
                    f"a batch must be a 1-d array of indices in [0, {num_images})"
                )
        return ImageLoader(
            self.decoder,
            lambda epoch: fixed,
            mode,
            self.num_workers,
            self.prefetch,
            self.max_bad_frac,
            self.stats_period,
            self.drop_empty,
            subprocesses=self.subprocesses,
        )

    def close(self) -> None:
        """Ends the loader's subprocesses ('subprocess' mode); the loader can still
        be iterated, which starts new ones."""
        if self._subprocess_loader is not None:
            self._subprocess_loader.close()
            self._subprocess_loader = None

    def _subprocesses(self):
        if self._subprocess_loader is None:
            threads = max(1, -(-self.num_workers // self.subprocesses))
            pool = SubprocessLoader(
                self.subprocesses,
                threads,
                self.prefetch,
                pin_memory=self.decoder.pin_memory,
                stats_period=self.stats_period,
            )
            weakref.finalize(self, pool.close)
            self._subprocess_loader = pool
        return self._subprocess_loader

    def set_epoch(self, epoch, start_batch=0):
        """Selects the shuffle (and crop seeds) of `epoch`: deterministic per
        (RNG_SEED, epoch), identical across runs and loader modes. `start_batch`
        skips the epoch's first batches without decoding them (resuming mid-epoch)."""
        self.epoch = epoch
        self.start_batch = start_batch
        if self.decoder_for is not None:
            self.decoder = self.decoder_for(epoch)

    def _plan(self):
        return self.plan(self.epoch)[self.start_batch :]

    def __len__(self):
        return len(self._plan())

    def epoch_length(self, epoch: int) -> int:
        """The number of batches of `epoch`, whole (TRAIN.SIZE_SCHEDULE stages
        differ in it)."""
        return len(self.plan(epoch))

    def _batches(self, batches):
        if self.num_workers == 0:  # Debugging: decode in the calling thread.
            return (self.decoder.load_batch(b, self.epoch) for b in batches)
        if self.mode == "processes":
            return iterate_processes(
                self.decoder, batches, self.epoch, self.num_workers, self.prefetch
            )
        if self.mode == "subprocess":
            return self._subprocesses().iterate(self.decoder, batches, self.epoch)
        engine = iterate_spdl if self.mode == "spdl" else iterate_threaded
        return engine(
            self.decoder,
            batches,
            self.epoch,
            self.num_workers,
            self.prefetch,
            self.stats_period,
        )

    def __iter__(self):
        batches = self._plan()
        total = sum(len(b) for b in batches)
        budget = self.max_bad_frac * total
        self.bad_images = []
        wait, images, start = 0.0, 0, time.perf_counter()
        self._stats = {}
        stream = self._batches(batches)
        try:
            while True:
                t0 = time.perf_counter()
                try:
                    batch = next(stream)
                except StopIteration:
                    break
                wait += time.perf_counter() - t0
                images += len(batch.labels)
                self._record_bad(batch.bad, budget, total)
                elapsed = time.perf_counter() - start
                self._stats = {
                    "data_wait_frac": wait / elapsed if elapsed > 0 else 0.0,
                    "data_wait_s": wait,
                    "img_per_s": images / elapsed if elapsed > 0 else 0.0,
                    "images": images,
                    "bad_images": len(self.bad_images),
                }
                if len(batch.labels) or not self.drop_empty:
                    yield batch.images, batch.labels
        finally:
            if hasattr(stream, "close"):
                stream.close()  # Stops the threads or workers on early exit.

    def _record_bad(self, bad, budget, total):
        for path, error in bad:
            logger.warning("skipped bad image %s (%s)", path, error)
        self.bad_images.extend(bad)
        if len(self.bad_images) > budget:
            # Raised as soon as the count passes the budget, not at the epoch's end.
            count = len(self.bad_images)
            raise BadImagesError(
                f"{count} images of {total} ({count / total:.1%}) failed to decode "
                f"in epoch {self.epoch}, more than DATA_LOADER.MAX_BAD_FRAC "
                f"({self.max_bad_frac}) allows; first: {self.bad_images[0][0]}"
            )

    def stats(self):
        """Returns the statistics of the current (or last) epoch so far.

        `data_wait_frac`: time the consumer spent blocked waiting for a batch, over
        the time since the epoch started; `data_wait_s`; `img_per_s`: images yielded
        per second of wall time; `images`; `bad_images`: images skipped.
        """
        return dict(self._stats)


def _check_format(cfg):
    if cfg.DATA.FORMAT == "folder" and is_remote(cfg.DATA.PATH):
        raise UserError(
            f"DATA.PATH {cfg.DATA.PATH} is remote: read it as DATA.FORMAT shards "
            "(pack it with tools/pack_dataset.py); folders of single images are read "
            "from local or network file systems only"
        )


def _index(cfg, split, check_train_classes=False):
    """The index of `split`; with `check_train_classes`, its class folders checked
    against the train split's first (a stray or missing folder named, before the
    NUM_CLASSES check that it would otherwise trip)."""
    _check_format(cfg)
    if cfg.DATA.FORMAT == "shards":
        index = load_shard_index(cfg.DATA.PATH, split)
    else:
        use_cache = cfg.DATA.INDEX_CACHE and not is_remote(cfg.OUT_DIR)
        cache = os.path.join(cfg.OUT_DIR, "data_index") if use_cache else None
        index = load_index(cfg.DATA.PATH, split, cache)
    if check_train_classes:
        _check_train_classes(cfg, index)
    if len(index.classes) > cfg.MODEL.NUM_CLASSES:
        raise ConfigError(
            f"MODEL.NUM_CLASSES ({cfg.MODEL.NUM_CLASSES}) is smaller than the "
            f"{len(index.classes)} class folders in {index.split_dir}"
        )
    return index


def _check_train_classes(cfg, index) -> None:
    """UserError naming the differing folders when the index's class folders are
    not the train split's (labels would mean other classes). Shards are written
    with their train split's classes (pack_dataset.py); folders numbered 0..N-1
    stand for the train split's N classes in order."""
    train_dir = os.path.join(cfg.DATA.PATH, cfg.TRAIN.SPLIT)
    if cfg.DATA.FORMAT == "shards" or cfg.TRAIN.SPLIT == cfg.TEST.SPLIT:
        return
    if not os.path.isdir(train_dir):
        return
    train_classes = sorted(
        e.name for e in os.scandir(train_dir) if e.is_dir() and e.name[0] != "."
    )
    by_number = index.classes == [str(i) for i in range(len(train_classes))]
    if train_classes == index.classes or by_number:
        return
    parts = []
    for what, names in (
        ("only here", sorted(set(index.classes) - set(train_classes))),
        (f"only in {cfg.TRAIN.SPLIT}", sorted(set(train_classes) - set(index.classes))),
    ):
        if names:
            shown = ", ".join(names[:5]) + (
                f", ... ({len(names)})" if names[5:] else ""
            )
            parts.append(f"{what}: {shown}")
    raise UserError(
        f"class folders of {index.split_dir} differ from those of {train_dir} "
        f"({'; '.join(parts)}): labels would name other classes"
    )


def _per_rank(cfg, key, world_size):
    total = cfg.TRAIN.BATCH_SIZE if key == "TRAIN.BATCH_SIZE" else cfg.TEST.BATCH_SIZE
    if total % world_size:
        raise ConfigError(
            f"{key} ({total}) must be divisible by the {world_size} ranks"
        )
    return total // world_size


def _decoder(cfg, index, train, im_size=None):
    return ImageDecoder(
        index,
        build_transform(cfg, train, im_size),
        im_size or cfg.TRAIN.IM_SIZE,
        cfg.RNG_SEED,
        pin_memory=cfg.DATA_LOADER.PIN_MEMORY and torch.cuda.is_available(),
        # CUDA graphs replay fixed shapes: every training batch keeps its size.
        replace_bad=train and (cfg.DATA_LOADER.REPLACE_BAD or cfg.TRAIN.CUDA_GRAPHS),
    )


def _loader(cfg, index, train, plan):
    decoder = _decoder(cfg, index, train)
    decoder_for = None
    if train and cfg.TRAIN.SIZE_SCHEDULE:
        by_size = {cfg.TRAIN.IM_SIZE: decoder}

        def decoder_for(epoch):
            size = train_stage(cfg, epoch)[0]
            if size not in by_size:
                by_size[size] = _decoder(cfg, index, True, size)
            return by_size[size]

        decoder = decoder_for(0)
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    mode = resolve_mode(cfg.DATA_LOADER.MODE, device_type)
    if train and mode != cfg.DATA_LOADER.MODE:
        logger.info(
            "data loader: %s mode (DATA_LOADER.MODE %s on %s)",
            mode,
            cfg.DATA_LOADER.MODE,
            device_type,
        )
    return ImageLoader(
        decoder,
        plan,
        mode,
        cfg.DATA_LOADER.NUM_WORKERS,
        cfg.DATA_LOADER.PREFETCH,
        cfg.DATA_LOADER.MAX_BAD_FRAC,
        cfg.DATA_LOADER.STATS_PERIOD,
        drop_empty=not train,
        decoder_for=decoder_for,
        subprocesses=cfg.DATA_LOADER.SUBPROCESSES,
    )


def check_data(cfg, splits: Sequence[str]) -> None:
    """Checks that DATA.PATH holds the split folders named by `splits` ('train',
    'test'), before any process starts; UserError naming what is missing."""
    _check_format(cfg)
    check = check_shard_split if cfg.DATA.FORMAT == "shards" else check_split
    for which in splits:
        split = cfg.TRAIN.SPLIT if which == "train" else cfg.TEST.SPLIT
        check(cfg.DATA.PATH, split)


def construct_train_loader(cfg, rank=None, world_size=None):
    """Returns the train ImageLoader of this rank over DATA.PATH/TRAIN.SPLIT.

    Each rank reads a disjoint shard of a (RNG_SEED, epoch) permutation, in batches of
    TRAIN.BATCH_SIZE / world_size, the same number of full batches on every rank.
    `rank`, `world_size`: override torch.distributed's (e.g. to simulate ranks).
    """
    rank, world_size = sharding.rank_and_world_size(rank, world_size)
    index = _index(cfg, cfg.TRAIN.SPLIT)
    batch_size = _per_rank(cfg, "TRAIN.BATCH_SIZE", world_size)
    stages = [s[2] // world_size for s in cfg.TRAIN.SIZE_SCHEDULE]
    if len(index) // world_size < max([batch_size, *stages]):
        raise UserError(
            f"{index.split_dir} has {len(index)} images, fewer than one batch of "
            f"{max([batch_size, *stages])} per rank (TRAIN.BATCH_SIZE "
            f"{cfg.TRAIN.BATCH_SIZE}, TRAIN.SIZE_SCHEDULE {cfg.TRAIN.SIZE_SCHEDULE})"
        )

    def plan(epoch):
        batch_size = train_stage(cfg, epoch)[1] // world_size
        if cfg.DATA.FORMAT == "shards":
            order = sharding.shard_order(
                index.counts, cfg.RNG_SEED, epoch, cfg.DATA.SHUFFLE_BUFFER
            )
        else:
            order = np.random.default_rng([cfg.RNG_SEED, epoch]).permutation(len(index))
        order = sharding.repeat_order(order, cfg.TRAIN.REPEATED_AUG)
        return sharding.split_order(order, batch_size, rank, world_size)

    return _loader(cfg, index, True, plan)


def construct_test_loader(cfg, rank=None, world_size=None, class_subset=False):
    """Returns the test ImageLoader of this rank over DATA.PATH/TEST.SPLIT.

    No shuffling; the ranks' shards cover every image exactly once (the last batch may
    be partial, and ranks may differ by one batch; a batch whose images all fail to
    decode is left out). Class folders must match the train split's when both exist,
    so that labels mean the same; with `class_subset` (the caller maps the split's
    labels to the model's classes: engine/test_sets.py) they may be some of them.
    """
    rank, world_size = sharding.rank_and_world_size(rank, world_size)
    index = _index(cfg, cfg.TEST.SPLIT, check_train_classes=not class_subset)
    batch_size = _per_rank(cfg, "TEST.BATCH_SIZE", world_size)
    batches = sharding.test_batches(len(index), batch_size, rank, world_size)
    return _loader(cfg, index, False, lambda epoch: batches)
