"""Checkpoint averaging: the mean of the weights of several checkpoints of one run
(the last K, or the K of lowest test top-1 error), written as one checkpoint file
that TEST.WEIGHTS, TRAIN.WEIGHTS and tools/export.py read like any other.

Checkpoints are single files or sharded (DCP) directories, in any mix; they are read
one at a time and summed in float64, so memory holds one checkpoint and the sum. The
EMA weights are averaged too when every checkpoint has them. Integer tensors (none
in a ViT) must be equal in all, and are kept as they are.
"""

import os
from collections.abc import Sequence
from typing import Any

import torch

from pycls_fast.checkpoint.files import (
    is_sharded,
    list_checkpoints,
    load_checkpoint,
    position,
    save_atomically,
)
from pycls_fast.checkpoint.sharded import read_meta, read_model_state
from pycls_fast.errors import CheckpointError, UserError
from pycls_fast.models.timm_compat import unwrap_state_dict
from pycls_fast.observe.logging import load_json_stats


def read_weights(path: str) -> tuple[dict, dict | None, dict[str, Any]]:
    """(model state, EMA state or None, meta {epoch, iter, cfg}) of a checkpoint
    file or sharded directory, as CPU tensors in their saved dtypes."""
    if is_sharded(path):
        meta = read_meta(path)
        return read_model_state(path), read_model_state(path, "ema") or None, meta
    checkpoint = load_checkpoint(path)
    if not isinstance(checkpoint, dict):
        raise CheckpointError(f"checkpoint {path} holds no state dict")
    ema = checkpoint.get("ema_state")
    ema = ema if isinstance(ema, dict) else None
    return unwrap_state_dict(checkpoint), ema, checkpoint


def _check_alike(first: dict, other: dict, path: str) -> None:
    if set(other) != set(first):
        odd = sorted(set(other) ^ set(first))[0]
        raise CheckpointError(f"cannot average {path}: its tensors differ ({odd})")
    for key, value in first.items():
        if tuple(other[key].shape) != tuple(value.shape):
            raise CheckpointError(
                f"cannot average {path}: {key} has shape {tuple(other[key].shape)}, "
                f"the first checkpoint's {tuple(value.shape)}"
            )


class _Sum:
    """A running float64 sum of state dicts; `mean()` in the first one's dtypes."""

    def __init__(self) -> None:
        self.total: dict[str, torch.Tensor] = {}
        self.dtypes: dict[str, torch.dtype] = {}
        self.count = 0

    def add(self, state: dict, path: str) -> None:
        if not self.total:
            self.dtypes = {k: v.dtype for k, v in state.items()}
            self.total = {
                k: v.double() if v.is_floating_point() else v.clone()
                for k, v in state.items()
            }
        else:
            _check_alike(self.total, state, path)
            for k, v in state.items():
                if v.is_floating_point():
                    self.total[k] += v.double()
                elif not torch.equal(self.total[k], v):
                    raise CheckpointError(
                        f"cannot average {path}: integer tensor {k} differs"
                    )
        self.count += 1

    def mean(self) -> dict[str, torch.Tensor]:
        return {
            k: (v / self.count).to(self.dtypes[k]) if v.is_floating_point() else v
            for k, v in self.total.items()
        }


def average_checkpoints(paths: Sequence[str], dst: str) -> dict[str, Any]:
    """Writes to `dst` the checkpoint whose weights (and EMA weights, when all have
    them) are the mean of those of `paths`; epoch, iteration and config are the last
    one's. Returns what was written, less the tensors."""
    if not paths:
        raise UserError("no checkpoints to average")
    model, ema, ema_everywhere, meta = _Sum(), _Sum(), True, {}
    for path in paths:
        state, ema_state, meta = read_weights(path)
        model.add(state, path)
        ema_everywhere = ema_everywhere and ema_state is not None
        if ema_everywhere:
            ema.add(ema_state, path)
    out = {
        "model_state": model.mean(),
        "epoch": meta.get("epoch"),
        "iter": meta.get("iter"),
        "cfg": meta.get("cfg"),
        "averaged": [os.path.basename(os.path.normpath(p)) for p in paths],
    }
    if ema_everywhere:
        out["ema_state"] = ema.mean()
    os.makedirs(os.path.dirname(os.path.abspath(dst)), exist_ok=True)
    save_atomically(out, dst)
    return {k: v for k, v in out.items() if not k.endswith("_state")}


def last_checkpoints(out_dir: str, k: int) -> list[str]:
    """The newest `k` complete checkpoints of a run, oldest first; CheckpointError
    when it has fewer."""
    found = list_checkpoints(out_dir)
    if len(found) < k:
        raise CheckpointError(
            f"{out_dir} has {len(found)} complete checkpoints, fewer than the {k} "
            "to average"
        )
    return found[-k:]


def epoch_test_errors(out_dir: str) -> dict[int, float]:
    """Test top-1 error after each epoch of a run (completed epochs -> %), read from
    OUT_DIR/stdout.log's test_epoch records (the last one of an epoch repeated by a
    resumed run)."""
    log = os.path.join(out_dir, "stdout.log")
    if not os.path.isfile(log):
        raise UserError(f"--best: no stdout.log in {out_dir} to rank checkpoints by")
    errors = {}
    for record in load_json_stats(log):
        if record.get("_type") != "test_epoch":
            continue
        epoch = str(record.get("epoch", "")).split("/")[0]
        if epoch.isdigit() and isinstance(record.get("top1_err"), (int, float)):
            errors[int(epoch)] = float(record["top1_err"])
    return errors


def best_checkpoints(out_dir: str, k: int) -> list[str]:
    """The `k` end-of-epoch checkpoints of a run of lowest test top-1 error (from its
    log), oldest first; CheckpointError when fewer than `k` have one."""
    errors = epoch_test_errors(out_dir)
    ranked = []
    for path in list_checkpoints(out_dir):
        epoch, iteration = position(path)
        if iteration == 0 and epoch in errors:
            ranked.append((errors[epoch], -epoch, path))
    if len(ranked) < k:
        raise CheckpointError(
            f"{out_dir} has {len(ranked)} end-of-epoch checkpoints with a test error "
            f"in its log, fewer than the {k} to average"
        )
    chosen = {path for _, _, path in sorted(ranked)[:k]}
    return [p for p in list_checkpoints(out_dir) if p in chosen]
