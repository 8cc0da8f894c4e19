"""Local paths and remote file systems (fsspec URLs) behind a few functions.

`DATA.PATH` and `OUT_DIR` may be URLs such as `s3://bucket/imagenet` or
`gs://bucket/runs/vit`: fsspec resolves them, with the file-system package the user
installs (s3fs, gcsfs, ...). Plain paths and `file://` URLs stay on the local file
system, through `os` (no fsspec in the hot path).
"""

import os
from typing import Any

from pycls_fast.errors import UserError


def is_remote(path: str) -> bool:
    """Whether `path` is a URL of a non-local file system (`s3://...`)."""
    return "://" in path and not path.startswith("file://")


def local(path: str) -> str:
    """`path` without a `file://` prefix."""
    return path[len("file://") :] if path.startswith("file://") else path


def filesystem(path: str) -> tuple[Any, str]:
    """Returns (fsspec file system, path within it) for a URL; UserError naming the
    package to install when its protocol's implementation is missing."""
    import fsspec.core

    try:
        return fsspec.core.url_to_fs(path)
    except ImportError as e:
        raise UserError(f"cannot open {path}: {e}") from None
    except ValueError as e:  # An unknown protocol.
        raise UserError(f"cannot open {path}: {e}") from None


def join(base: str, *parts: str) -> str:
    """Joins path parts, with '/' for URLs."""
    if is_remote(base):
        return "/".join([base.rstrip("/"), *parts])
    return os.path.join(local(base), *parts)


def exists(path: str) -> bool:
    """Whether a file or folder exists at `path` (local or remote)."""
    if not is_remote(path):
        return os.path.exists(local(path))
    fs, p = filesystem(path)
    return fs.exists(p)


def read_bytes(path: str) -> bytes:
    """The whole file at `path` (local or remote)."""
    if not is_remote(path):
        with open(local(path), "rb") as f:
            return f.read()
    fs, p = filesystem(path)
    return fs.cat_file(p)


def open_file(path: str, mode: str = "rb"):
    """A file object for `path` (local or remote), for use in a `with` block."""
    if not is_remote(path):
        return open(local(path), mode)
    fs, p = filesystem(path)
    return fs.open(p, mode)
