"""Which checkpoints to keep: the last TRAIN.CHECKPOINT_KEEP, the newest complete
one always, and with TRAIN.CHECKPOINT_KEEP_BEST the one of lowest test top-1 error,
named by `checkpoints/best.json` ({"checkpoint", "epoch", "top1_err"})."""

import contextlib
import json
import logging
import os
from collections.abc import Collection
from typing import Any

from pycls_fast.checkpoint.files import (
    checkpoint_dir,
    list_checkpoints,
    position,
    remove_checkpoint,
)
from pycls_fast.errors import CheckpointError

logger = logging.getLogger(__name__)

BEST_FILE = "best.json"


def best_path(out_dir: str) -> str:
    """OUT_DIR/checkpoints/best.json."""
    return os.path.join(checkpoint_dir(out_dir), BEST_FILE)


def read_best(out_dir: str) -> dict[str, Any] | None:
    """The best record ({"checkpoint": name, "epoch", "top1_err"}) when it names a
    checkpoint that still exists, else None."""
    try:
        with open(best_path(out_dir)) as f:
            best = json.load(f)
        name = best["checkpoint"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return best if os.path.exists(os.path.join(checkpoint_dir(out_dir), name)) else None


def best_checkpoint(out_dir: str) -> str:
    """Path of the checkpoint that best.json names; CheckpointError when there is
    none (the run was not trained with TRAIN.CHECKPOINT_KEEP_BEST True)."""
    best = read_best(out_dir)
    if best is None:
        raise CheckpointError(
            f"no best checkpoint in {checkpoint_dir(out_dir)}: {BEST_FILE} is missing "
            "or names a deleted file (train with TRAIN.CHECKPOINT_KEEP_BEST True)"
        )
    return os.path.join(checkpoint_dir(out_dir), best["checkpoint"])


def write_best(out_dir: str, name: str, epoch: int, top1_err: float) -> dict[str, Any]:
    """Writes best.json atomically (temporary name, fsync, rename); returns it."""
    best = {"checkpoint": name, "epoch": epoch, "top1_err": top1_err}
    path = best_path(out_dir)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(best, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return best


def forget_best(out_dir: str) -> None:
    """Deletes best.json (its checkpoint was overwritten by other weights)."""
    with contextlib.suppress(FileNotFoundError):
        os.remove(best_path(out_dir))


def to_delete(
    paths: list[str], keep_last: int, protected: Collection[str] = ()
) -> list[str]:
    """The checkpoints (oldest first in `paths`) that retention deletes: all but the
    last `keep_last` (0: none deleted), never the newest nor those in `protected`
    (base names)."""
    if keep_last <= 0 or not paths:
        return []
    kept = set(paths[-keep_last:]) | {paths[-1]}
    return [p for p in paths if p not in kept and os.path.basename(p) not in protected]


def keep_only(out_dir: str, names: Collection[str]) -> list[str]:
    """Deletes from OUT_DIR/checkpoints every checkpoint (complete or not: a node's
    own copy of a sharded one lacks `.metadata`) whose name is not in `names`
    (another folder's retention: rank 0's); returns the paths deleted."""
    folder = checkpoint_dir(out_dir)
    if not os.path.isdir(folder):
        return []
    doomed = [
        os.path.join(folder, name)
        for name in sorted(os.listdir(folder))
        if position(name) is not None and name not in names
    ]
    return _remove(doomed, log_each=False)


def apply_retention(
    out_dir: str, keep_last: int, protected: Collection[str] = ()
) -> list[str]:
    """Deletes what `to_delete` names (call on rank 0 only); returns the paths
    deleted. A failed deletion is logged, not fatal: the checkpoints are intact."""
    doomed = to_delete(list_checkpoints(out_dir), keep_last, protected)
    return _remove(doomed, log_each=True)


def _remove(paths: list[str], log_each: bool) -> list[str]:
    """Deletes each checkpoint of `paths`; returns those deleted. A failed deletion
    is a warning (the checkpoints are intact); `log_each` logs every deletion."""
    deleted = []
    for path in paths:
        try:
            remove_checkpoint(path)
        except OSError as e:
            logger.warning("cannot delete old checkpoint %s: %s", path, e)
            continue
        deleted.append(path)
        if log_each:
            logger.info("deleted old checkpoint %s", path)
    return deleted
