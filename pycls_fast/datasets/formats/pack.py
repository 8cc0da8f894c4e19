"""Packs a folder split into tar shards (the format of formats/shards.py), resumably.

Images go into the shards in a seeded random order, each shard up to `shard_bytes`
of image data. A shard is staged in a local temporary file, its member offsets read
back, then renamed (local) or uploaded (URL: an object appears whole or not at all)
under its final name; the index files are written last. A rerun keeps the shards
already there (reading back their offsets) and continues with the next one, so an
interrupted run loses at most one shard's work. Image bytes are copied as they are:
bad images are found, logged and counted by the loader, as for folders.
"""

import io
import json
import os
import shutil
import tarfile
import tempfile
from collections.abc import Callable

import numpy as np

from pycls_fast import storage
from pycls_fast.datasets.formats.index import FileIndex
from pycls_fast.datasets.formats.shards import (
    FORMAT,
    INDEX_FILE,
    META_FILE,
    member_ext,
    member_key,
    read_members,
)
from pycls_fast.errors import UserError


def shard_name(split: str, k: int) -> str:
    """The file name of shard `k` of `split`: `<split>-000042.tar`."""
    return f"{split}-{k:06d}.tar"


def _tarinfo(name, size):
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = size, 0o444, 0  # Reproducible bytes.
    return info


def _image_members(members):
    """(name, offset, size) of the image members (not the .cls ones), in order."""
    return [m for m in members if not m[0].endswith(".cls")]


def _expected_name(index, i):
    name = os.fsdecode(index.names[i])
    return f"{member_key(index.classes[index.labels[i]], name)}.{member_ext(name)}"


def _write_shard(index, order, start, shard_bytes, staging):
    """Writes images order[start:...] to `staging` until `shard_bytes` of image data
    (at least one image); returns the position after the last image written."""
    written, pos = 0, start
    with tarfile.open(staging, "w", format=tarfile.GNU_FORMAT) as tar:
        while pos < len(order) and (written < shard_bytes or pos == start):
            i = int(order[pos])
            data = index.read(i)
            name = os.fsdecode(index.names[i])
            cls = index.classes[index.labels[i]]
            key = member_key(cls, name)
            tar.addfile(
                _tarinfo(f"{key}.{member_ext(name)}", len(data)), io.BytesIO(data)
            )
            label = str(int(index.labels[i])).encode()
            tar.addfile(_tarinfo(f"{key}.cls", len(label)), io.BytesIO(label))
            written += len(data)
            pos += 1
    return pos


def _publish(staging, dest):
    if storage.is_remote(dest):
        fs, p = storage.filesystem(dest)
        fs.put_file(staging, p)
        os.remove(staging)
    else:
        shutil.move(staging, storage.local(dest))


def pack_split(
    index: FileIndex,
    out: str,
    split: str,
    shard_bytes: int,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
) -> dict:
    """Packs `index` into `out/split/` (a path or URL); returns the shards.json dict.

    `progress(done, total)` is called after each shard with image counts.
    """
    split_dir = storage.join(out, split)
    if not storage.is_remote(split_dir):
        os.makedirs(storage.local(split_dir), exist_ok=True)
    order = np.random.default_rng(seed).permutation(len(index))
    shards, offsets, sizes, pos = [], [], [], 0
    staging_dir = tempfile.mkdtemp(prefix="pack_")
    try:
        while pos < len(order):
            name = shard_name(split, len(shards))
            dest = storage.join(split_dir, name)
            if storage.exists(dest):  # Written by an earlier, interrupted run.
                with storage.open_file(dest) as f:
                    images = _image_members(read_members(f))
                expected = [_expected_name(index, int(i)) for i in order[pos:]]
                if [m[0] for m in images] != expected[: len(images)]:
                    raise UserError(
                        f"{dest} holds other images than this run would write there "
                        "(another dataset or --seed): remove the split's shards or "
                        "pack into another folder"
                    )
            else:
                staging = os.path.join(staging_dir, name)
                end = _write_shard(index, order, pos, shard_bytes, staging)
                with open(staging, "rb") as f:
                    images = _image_members(read_members(f))
                assert len(images) == end - pos
                _publish(staging, dest)
            shards.append({"name": name, "images": len(images)})
            offsets += [off for _, off, _ in images]
            sizes += [size for _, _, size in images]
            pos += len(images)
            if progress is not None:
                progress(pos, len(order))
    finally:
        shutil.rmtree(staging_dir, ignore_errors=True)
    meta = {
        "format": FORMAT,
        "split": split,
        "seed": seed,
        "classes": index.classes,
        "images": len(order),
        "shards": shards,
    }
    counts = [s["images"] for s in shards]
    arrays = {
        "shard": np.repeat(np.arange(len(shards), dtype=np.int32), counts),
        "offset": np.array(offsets, dtype=np.int64),
        "size": np.array(sizes, dtype=np.int64),
        "labels": index.labels[order].astype(np.int32),
    }
    _write_index(split_dir, meta, arrays)
    return meta


def _write_index(split_dir, meta, arrays):
    """index.npz, then shards.json: a reader checks for shards.json first, so a split
    counts as packed only once both are there."""
    with tempfile.TemporaryDirectory() as tmp:
        npz = os.path.join(tmp, INDEX_FILE)
        np.savez(npz, **arrays)
        _publish(npz, storage.join(split_dir, INDEX_FILE))
        js = os.path.join(tmp, META_FILE)
        with open(js, "w") as f:
            json.dump(meta, f, indent=1)
        _publish(js, storage.join(split_dir, META_FILE))
