"""Checkpoint files: names, listing, atomic writes, safe loading, deletion.

Names: `model_epoch_0003.pyth` after epoch 3 (1-based, as pycls names them), or
`model_epoch_0003_iter_000200.pyth` for a checkpoint 200 iterations into epoch 3;
FSDP runs write directories of the same names ending in `.dcp` (sharded.py). A write
goes to a temporary name and is renamed when complete, so a crash mid-write never
leaves a file that looks like a checkpoint.

Loading never runs code: files are read with `torch.load(weights_only=True)`, which
accepts tensors and plain Python values only.
"""

import os
import re
import shutil

import torch

from pycls_fast.errors import CheckpointError

SUFFIX = ".pyth"
SHARDED_SUFFIX = ".dcp"

_NAME = re.compile(r"^model_epoch_(\d{4})(?:_iter_(\d{6}))?\.(pyth|dcp)$")


def checkpoint_dir(out_dir: str) -> str:
    """OUT_DIR/checkpoints."""
    return os.path.join(out_dir, "checkpoints")


def checkpoint_name(epoch: int, iteration: int = 0, suffix: str = SUFFIX) -> str:
    """File name of a checkpoint after `iteration` iterations of 0-based `epoch`
    (iteration 0: the end of the epoch before, named by 1-based epoch number)."""
    if iteration == 0:
        return f"model_epoch_{epoch:04d}{suffix}"
    return f"model_epoch_{epoch + 1:04d}_iter_{iteration:06d}{suffix}"


def position(name: str):
    """(completed epochs, iterations into the next one) of a checkpoint name, or
    None when `name` is not one."""
    m = _NAME.match(os.path.basename(name))
    if not m:
        return None
    epoch, iteration = int(m.group(1)), int(m.group(2) or 0)
    return (epoch - 1, iteration) if iteration else (epoch, 0)


def is_sharded(path: str) -> bool:
    """Whether `path` is a sharded (DCP) checkpoint directory."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, ".metadata"))


def list_checkpoints(out_dir: str) -> list:
    """Complete checkpoints in OUT_DIR/checkpoints, oldest first."""
    return checkpoints_in(checkpoint_dir(out_dir))


def checkpoints_in(folder: str) -> list:
    """Complete checkpoints in `folder` itself, oldest first."""
    if not os.path.isdir(folder):
        return []
    found = [
        (pos, n)
        for n in os.listdir(folder)
        if (pos := position(n)) is not None
        and (n.endswith(SUFFIX) or is_sharded(os.path.join(folder, n)))
    ]
    return [os.path.join(folder, n) for _, n in sorted(found)]


def last_checkpoint(out_dir: str):
    """Path of the newest complete checkpoint, or None."""
    found = list_checkpoints(out_dir)
    return found[-1] if found else None


def resolve_weights(path: str) -> tuple[str, str]:
    """The checkpoint that a weights path names, and how it was found: (path,
    "given") for a checkpoint file or sharded directory; for a run folder or its
    checkpoints folder, (its newest complete checkpoint, "newest in FOLDER").
    CheckpointError when there is none, listing what the folder holds."""
    if os.path.isfile(path) or is_sharded(path):
        return path, "given"
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint not found: {path}")
    for folder in (checkpoint_dir(path), path):
        found = checkpoints_in(folder)
        if found:
            return found[-1], f"newest in {folder}"
    names = sorted(os.listdir(path))
    shown = ", ".join(names[:8]) + (f", ... ({len(names)} in all)" if names[8:] else "")
    raise CheckpointError(
        f"no complete checkpoint in {path} (nor in its checkpoints/ folder); it "
        f"holds: {shown or 'nothing'}"
    )


def remove_partial(out_dir: str) -> list:
    """Deletes what writes cut short left behind (temporary files and directories);
    call it only while no other process writes there (the OUT_DIR lock is held)."""
    folder = checkpoint_dir(out_dir)
    if not os.path.isdir(folder):
        return []
    removed = []
    for name in os.listdir(folder):
        if ".tmp" in name or name.endswith(".old"):
            path = os.path.join(folder, name)
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.remove(path)
            removed.append(path)
    return removed


def remove_checkpoint(path: str) -> None:
    """Deletes a checkpoint file or sharded directory. A directory is renamed to
    `.old` first, so a crash mid-deletion never leaves one that looks complete
    (remove_partial clears it)."""
    if os.path.isdir(path):
        old = path + ".old"
        os.replace(path, old)
        shutil.rmtree(old, ignore_errors=True)
    elif os.path.exists(path):
        os.remove(path)


def sync_folder(folder: str) -> None:
    """fsyncs the folder's entries: a rename in it survives a power loss."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_atomically(obj, path: str) -> None:
    """torch.save to a temporary name, fsync, rename, fsync the folder: a crash or
    a power loss never leaves a half-written file at `path`."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        sync_folder(os.path.dirname(os.path.abspath(path)))
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def save_checkpoint(out_dir: str, state: dict, epoch: int, iteration: int = 0) -> str:
    """Writes `state` atomically as the checkpoint of (epoch, iteration); returns its
    path. On failure (disk full, read-only) the previous checkpoints stay intact and
    the error propagates."""
    folder = checkpoint_dir(out_dir)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, checkpoint_name(epoch, iteration))
    save_atomically(state, path)
    return path


def safe_load(source, name: str, mmap: bool = False):
    """torch.load with weights_only (tensors and plain values only, never code);
    CheckpointError naming `name` when `source` holds anything else or is
    unreadable. `mmap`: the tensors are views of the file mapped into memory (read
    from disk when touched, not copied: a rank that takes its shards of them
    reads only those); torch's zip format only, others are read whole."""
    if not _looks_like_torch_save(source):
        raise CheckpointError(
            f"cannot read checkpoint {name}: not a file that torch.save wrote (it "
            "starts neither as a zip archive nor as a pickle)"
        )
    try:
        if mmap:
            try:
                return torch.load(
                    source, map_location="cpu", weights_only=True, mmap=True
                )
            except RuntimeError as e:
                if "mmap" not in str(e):
                    raise
        return torch.load(source, map_location="cpu", weights_only=True)
    except Exception as e:
        text = str(e).strip()
        if "Unsupported global" in text:
            what = "unsupported types"
            for line in text.splitlines():
                if "Unsupported global" in line:
                    what = line.split("GLOBAL", 1)[-1].strip().split()[0]
                    break
            raise CheckpointError(
                f"cannot read checkpoint {name}: it holds objects that loading would "
                f"run code for ({what}); pycls_fast loads only tensors and plain "
                "values (checkpoints of pycls_fast before weights_only loading hold "
                "numpy RNG states: see docs/RELIABILITY.md)"
            ) from None
        if "weights_only" in text:  # torch's advice to load unsafely: not ours
            text = text.rsplit("error:", 1)[-1].strip()
        first = text.splitlines()[0] if text else type(e).__name__
        raise CheckpointError(
            f"cannot read checkpoint {name}: {first} (a damaged or partial file?)"
        ) from None


def _looks_like_torch_save(source) -> bool:
    """Whether `source` (a path or a seekable binary file) starts as torch.save's
    zip archive or its older pickle format (protocol 2 or above)."""
    if isinstance(source, str | os.PathLike):
        with open(source, "rb") as f:
            head = f.read(4)
    else:
        where = source.tell()
        head = source.read(4)
        source.seek(where)
    return head.startswith(b"PK\x03\x04") or head[:1] == b"\x80"


def load_checkpoint(path: str, mmap: bool = False) -> dict:
    """Loads a checkpoint file (CPU tensors; memory-mapped with `mmap`, see
    `safe_load`); CheckpointError if unreadable or if it holds anything but tensors
    and plain values."""
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint not found: {path}")
    return safe_load(path, path, mmap)
