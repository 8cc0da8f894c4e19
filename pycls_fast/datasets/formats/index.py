"""File index of an ImageNet-layout folder (`<root>/<split>/<class>/<image>`), cached.

Classes are the sub-folders of the split, sorted by name (WordNet ids such as
`n01440764` sort into ImageNet's usual label order), or by number when every folder is
named by one (ImageNet-V2's `0` .. `999` are label numbers); images are the files with
an image extension, sorted by name. File names are kept as one numpy bytes array
relative to their class folder, and labels as int32, not as Python objects: 1.28M
ImageNet images take ~25 MB of names and 5 MB of labels, and building the index holds at
most one class folder's names as Python strings (peak memory: docs/PERFORMANCE.md, "File
index"). Forked worker processes share the arrays' pages, as they touch no reference
counts.
"""

import hashlib
import json
import os
from dataclasses import dataclass

import numpy as np

from pycls_fast.datasets.images.decode import read_file
from pycls_fast.errors import UserError

IMAGE_EXTENSIONS = (".jpeg", ".jpg", ".png")

# Bump when the cache file format changes.
_CACHE_VERSION = 2


@dataclass(frozen=True)
class FileIndex:
    """The images of one split of a folder dataset.

    `split_dir`: absolute path of the split folder; `classes`: sorted folder names;
    `names`: numpy bytes array (N,) of file names within their class folder;
    `labels`: int32 array (N,), index into `classes`.
    """

    split_dir: str
    classes: list
    names: np.ndarray
    labels: np.ndarray

    def __len__(self) -> int:
        return len(self.labels)

    def path(self, i: int) -> str:
        """Returns the absolute path (str) of image `i`."""
        name = os.fsdecode(self.names[i])
        return os.path.join(self.split_dir, self.classes[self.labels[i]], name)

    def read(self, i: int) -> bytes:
        """Returns the bytes of image `i` (OSError when it cannot be read)."""
        return read_file(self.path(i))


def _class_dirs(split_dir):
    if not os.path.isdir(split_dir):
        raise UserError(f"dataset split folder not found: {split_dir}")
    with os.scandir(split_dir) as it:
        names = [e.name for e in it if e.is_dir() and not e.name.startswith(".")]
    # Folders named by label number (ImageNet-V2's 0..999) sort as numbers.
    numeric = bool(names) and all(n.isdigit() for n in names)
    classes = sorted(names, key=int) if numeric else sorted(names)
    if not classes:
        raise UserError(
            f"no class folders in {split_dir} (expected <split>/<class>/<image>)"
        )
    return classes


def _image_names(class_dir):
    """The sorted image file names of one class folder, as a numpy bytes array."""
    with os.scandir(class_dir) as it:
        # The extension test first: is_file() may cost a stat where the file system
        # does not report entry types (some network file systems).
        files = sorted(
            e.name
            for e in it
            if e.name.lower().endswith(IMAGE_EXTENSIONS) and e.is_file()
        )
    if not files:
        raise UserError(f"class folder has no images (.JPEG/.jpg/.png): {class_dir}")
    # os.fsencode keeps non-ASCII names (numpy's own str -> bytes is ASCII only).
    return np.array([os.fsencode(f) for f in files], dtype=np.bytes_)


def scan_split(split_dir: str) -> FileIndex:
    """Scans `split_dir` and returns its FileIndex; UserError on a bad layout."""
    split_dir = os.path.abspath(split_dir)
    classes = _class_dirs(split_dir)
    per_class = [_image_names(os.path.join(split_dir, name)) for name in classes]
    counts = [len(names) for names in per_class]
    names = np.concatenate(per_class)
    del per_class
    labels = np.repeat(np.arange(len(classes), dtype=np.int32), counts)
    return FileIndex(split_dir, classes, names, labels)


def _fingerprint(split_dir, classes):
    """Modification times of the split and class folders: adding, removing or renaming
    an image changes its folder's mtime, which invalidates the cache."""
    mtimes = [os.stat(split_dir).st_mtime_ns]
    mtimes += [os.stat(os.path.join(split_dir, c)).st_mtime_ns for c in classes]
    return hashlib.sha1(json.dumps(mtimes).encode()).hexdigest()


def _cache_file(cache_dir, split_dir):
    key = hashlib.sha1(split_dir.encode()).hexdigest()[:16]
    return os.path.join(cache_dir, f"index_{os.path.basename(split_dir)}_{key}.npz")


def check_split(root: str, split: str) -> list[str]:
    """Raises UserError, with load_index's message, when `root/split` is not an
    ImageNet-layout folder; cheap (lists class folders only), so a launcher can
    check before it starts any process. Returns the class folders, in label order."""
    _check_root(root)
    return _class_dirs(os.path.abspath(os.path.join(root, split)))


def class_names(root: str, split: str) -> list[str]:
    """The class folder names of `root/split` in label order (UserError when it is
    not an ImageNet-layout folder)."""
    _check_root(root)
    return _class_dirs(os.path.abspath(os.path.join(root, split)))


def _check_root(root):
    if not root:
        raise UserError("DATA.PATH is not set (the dataset root folder)")
    if not os.path.isdir(root):
        where = "" if os.path.isabs(root) else f" (relative to {os.getcwd()})"
        raise UserError(f"DATA.PATH folder not found: {root}{where}")


def load_index(root: str, split: str, cache_dir: str | None = None) -> FileIndex:
    """Returns the FileIndex of `root/split`, read from `cache_dir` when still valid.

    With `cache_dir` set, a fresh scan is written there (atomically) for the next run;
    the cache is keyed by the split folder's absolute path and invalidated when any
    class folder (or the split folder) changes.
    """
    _check_root(root)
    split_dir = os.path.abspath(os.path.join(root, split))
    if not cache_dir:
        return scan_split(split_dir)
    classes = _class_dirs(split_dir)
    fingerprint = _fingerprint(split_dir, classes)
    path = _cache_file(cache_dir, split_dir)
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(str(z["meta"]))
            if meta == {"version": _CACHE_VERSION, "fingerprint": fingerprint}:
                return FileIndex(
                    split_dir, list(z["classes"].astype(str)), z["names"], z["labels"]
                )
    except (OSError, KeyError, ValueError):
        pass  # No cache yet, or an unreadable one: rescan.
    index = scan_split(split_dir)
    os.makedirs(cache_dir, exist_ok=True)
    meta = json.dumps({"version": _CACHE_VERSION, "fingerprint": fingerprint})
    tmp = f"{path}.{os.getpid()}.tmp.npz"
    np.savez(
        tmp,
        meta=np.array(meta),
        classes=np.array(index.classes),
        names=index.names,
        labels=index.labels,
    )
    os.replace(tmp, path)
    return index
