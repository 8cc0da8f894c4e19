"""Tar shards of a split: the format, its index, and a reader for the loader.

Layout (written by tools/pack_dataset.py; WebDataset-compatible shards):

    DATA.PATH/<split>/
      shards.json              # format, classes, shard names and image counts
      index.npz                # per image: shard, data offset, size, label (int arrays)
      <split>-000000.tar       # <class>/<key>.<ext> + <class>/<key>.cls, in turn
      ...

Images are in a seeded random order across the shards (so that a window of a few
consecutive shards mixes all classes); image `i` of the index is the i-th image in
shard order, so each shard's images are a contiguous range of indices. Reading image
`i` is one positional read in an already open shard file (local or network file
system), or one ranged GET (object store): no open, stat or listing per image.
"""

import json
import os
import tarfile
import threading
from dataclasses import dataclass, field

import numpy as np

from pycls_fast import storage
from pycls_fast.errors import UserError

FORMAT = "pycls_fast-shards-1"
META_FILE = "shards.json"
INDEX_FILE = "index.npz"

# Open shard files kept per process: a rank reads a window of a few shards at a time.
_MAX_OPEN = 64


@dataclass
class ShardIndex:
    """The images of one split packed in tar shards.

    `split_dir`: path or URL of the split folder; `classes`: class names (label order);
    `shard_names`: file names of the shards; `counts`: int64 (S,) images per shard;
    `shard`: int32 (N,), `offset`: int64 (N,) byte offset of the image's data in its
    shard, `size`: int64 (N,) bytes; `labels`: int32 (N,).
    """

    split_dir: str
    classes: list
    shard_names: list
    counts: np.ndarray
    shard: np.ndarray
    offset: np.ndarray
    size: np.ndarray
    labels: np.ndarray
    _fds: dict = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __len__(self) -> int:
        return len(self.labels)

    def __getstate__(self):
        # Worker processes open their own files.
        state = dict(self.__dict__)
        state["_fds"], state["_lock"] = {}, None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def shard_path(self, s: int) -> str:
        """Path or URL of shard `s`."""
        return storage.join(self.split_dir, self.shard_names[s])

    def path(self, i: int) -> str:
        """The name of image `i` in logs: `<shard path>:<member name>`."""
        s, offset = int(self.shard[i]), int(self.offset[i])
        name = f"@{offset}"
        try:  # The member's tar header is the 512 bytes before its data.
            info = tarfile.TarInfo.frombuf(
                self._pread(s, offset - 512, 512), "utf-8", "surrogateescape"
            )
            name = info.name
        except (OSError, tarfile.TarError, ValueError):
            pass
        return f"{self.shard_path(s)}:{name}"

    def read(self, i: int) -> bytes:
        """Returns the bytes of image `i` (OSError when they cannot be read)."""
        s = int(self.shard[i])
        size = int(self.size[i])
        data = self._pread(s, int(self.offset[i]), size)
        if len(data) != size:
            raise OSError(f"shard truncated: {self.shard_path(s)}")
        return data

    def _pread(self, s, offset, size):
        if storage.is_remote(self.split_dir):
            fs, p = storage.filesystem(self.shard_path(s))
            return fs.cat_file(p, start=offset, end=offset + size)
        entry = self._acquire(s)
        try:
            return os.pread(entry[0], size, offset)
        finally:
            with self._lock:
                entry[1] -= 1

    def _acquire(self, s):
        """The [fd, users] entry of shard `s`, opened if need be, one user more. A
        file is closed only when no thread reads it: a closed number can be reused
        by the next open, and a late read would then read another file."""
        with self._lock:
            entry = self._fds.get(s)
            if entry is None:
                if len(self._fds) >= _MAX_OPEN:
                    idle = [k for k, (_, users) in self._fds.items() if not users]
                    for k in idle[: len(self._fds) - _MAX_OPEN + 1]:
                        os.close(self._fds.pop(k)[0])
                fd = os.open(storage.local(self.shard_path(s)), os.O_RDONLY)
                entry = self._fds[s] = [fd, 0]
            entry[1] += 1
            return entry

    def close(self) -> None:
        """Closes the open shard files (call when no thread reads any more)."""
        with self._lock:
            for fd, _ in self._fds.values():
                os.close(fd)
            self._fds.clear()


def check_shard_split(root: str, split: str) -> None:
    """Raises UserError when `root/split` holds no shard index (shards.json)."""
    meta = storage.join(root, split, META_FILE)
    if not storage.exists(meta):
        raise UserError(
            f"no {META_FILE} in {storage.join(root, split)} (DATA.FORMAT shards: "
            "pack the split with tools/pack_dataset.py)"
        )


def load_shard_index(root: str, split: str) -> ShardIndex:
    """Returns the ShardIndex of `root/split` (a path or URL); UserError when the split
    is not a packed split."""
    if not root:
        raise UserError("DATA.PATH is not set (the dataset root folder)")
    check_shard_split(root, split)
    split_dir = storage.join(root, split)
    if not storage.is_remote(split_dir):
        split_dir = os.path.abspath(storage.local(split_dir))
    meta = json.loads(storage.read_bytes(storage.join(split_dir, META_FILE)))
    if meta.get("format") != FORMAT:
        raise UserError(
            f"{storage.join(split_dir, META_FILE)}: format {meta.get('format')!r}, "
            f"expected {FORMAT!r} (pack it again with tools/pack_dataset.py)"
        )
    index_file = storage.join(split_dir, INDEX_FILE)
    with storage.open_file(index_file) as f, np.load(f, allow_pickle=False) as z:
        arrays = {k: z[k] for k in ("shard", "offset", "size", "labels")}
    counts = np.array([s["images"] for s in meta["shards"]], dtype=np.int64)
    if counts.sum() != len(arrays["labels"]):
        raise UserError(f"{split_dir}: {INDEX_FILE} does not match {META_FILE}")
    return ShardIndex(
        split_dir,
        list(meta["classes"]),
        [s["name"] for s in meta["shards"]],
        counts,
        **arrays,
    )


def member_key(class_name: str, file_name: str) -> str:
    """The WebDataset key of an image: `<class>/<stem>`, dots in the stem replaced
    (WebDataset splits a member name at the first dot of its base name)."""
    stem, _ = os.path.splitext(file_name)
    return f"{class_name}/{stem.replace('.', '_')}"


def member_ext(file_name: str) -> str:
    """The member extension of an image file: its own, lower case ('jpeg', 'png')."""
    return os.path.splitext(file_name)[1].lstrip(".").lower()


def read_members(fileobj) -> list[tuple[str, int, int]]:
    """(name, data offset, size) of each member of a tar file object."""
    with tarfile.open(fileobj=fileobj, mode="r:") as tar:
        return [(m.name, m.offset_data, m.size) for m in tar]
