"""Checkpoints: atomic writes under OUT_DIR/checkpoints, newest-complete lookup.

A checkpoint is one torch file holding everything a resumed run needs to continue
bit-for-bit on a CPU: model, EMA, optimizer, master weights (O2), loss scaler, RNG
states and the loader position (epoch, iteration), plus the config it was made with.

Names: `model_epoch_0003.pyth` after epoch 3 (1-based, as pycls names them), or
`model_epoch_0003_iter_000200.pyth` for a checkpoint 200 iterations into epoch 3. A
write goes to a temporary name and is renamed when complete, so a crash mid-write
never leaves a file that looks like a checkpoint. FSDP runs write sharded checkpoints
instead, directories of the same names ending in `.dcp` (core/sharded_checkpoint.py).
"""

import os
import random
import re
import shutil

import numpy as np
import torch

from pycls_fast.core.sharded_checkpoint import is_sharded, read_model_state
from pycls_fast.errors import CheckpointError
from pycls_fast.models.timm_compat import unwrap_state_dict

_NAME = re.compile(r"^model_epoch_(\d{4})(?:_iter_(\d{6}))?\.(pyth|dcp)$")


def checkpoint_dir(out_dir):
    return os.path.join(out_dir, "checkpoints")


def checkpoint_name(epoch, iteration=0, suffix=".pyth"):
    """File name of a checkpoint after `iteration` iterations of 0-based `epoch`
    (iteration 0: the end of the epoch before, named by 1-based epoch number)."""
    if iteration == 0:
        return f"model_epoch_{epoch:04d}{suffix}"
    return f"model_epoch_{epoch + 1:04d}_iter_{iteration:06d}{suffix}"


def _position(name):
    m = _NAME.match(name)
    if not m:
        return None
    epoch, iteration = int(m.group(1)), int(m.group(2) or 0)
    # (completed epochs, iterations into the next one)
    return (epoch - 1, iteration) if iteration else (epoch, 0)


def list_checkpoints(out_dir):
    """Complete checkpoints in OUT_DIR/checkpoints, oldest first."""
    folder = checkpoint_dir(out_dir)
    if not os.path.isdir(folder):
        return []
    found = [
        (pos, n)
        for n in os.listdir(folder)
        if (pos := _position(n)) is not None
        and (n.endswith(".pyth") or is_sharded(os.path.join(folder, n)))
    ]
    return [os.path.join(folder, n) for _, n in sorted(found)]


def remove_partial(out_dir):
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


def last_checkpoint(out_dir):
    """Path of the newest complete checkpoint, or None."""
    found = list_checkpoints(out_dir)
    return found[-1] if found else None


def rng_state():
    return {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def set_rng_state(state):
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(out_dir, state, epoch, iteration=0):
    """Writes `state` atomically as the checkpoint of (epoch, iteration); returns its
    path. On failure (disk full, read-only) the previous checkpoints stay intact and
    the error propagates."""
    folder = checkpoint_dir(out_dir)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, checkpoint_name(epoch, iteration))
    save_atomically(state, path)
    return path


def save_atomically(obj, path):
    """torch.save to a temporary name, fsync, rename: a crash never leaves a
    half-written file at `path`."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def load_checkpoint(path):
    """Loads a checkpoint file (CPU tensors); CheckpointError if unreadable."""
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint not found: {path}")
    try:
        # Our own files: they hold RNG states and numpy arrays, not only tensors.
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:
        raise CheckpointError(f"cannot read checkpoint {path}: {e}") from None


def load_model_weights(model, path, *, allow_missing_head=False, use_ema=False):
    """Loads model weights (the EMA weights with `use_ema`, when the checkpoint has
    them) from a checkpoint file or sharded checkpoint directory into `model` (not
    yet sharded); names the file on mismatch."""
    if is_sharded(path):
        state = (use_ema and read_model_state(path, "ema")) or read_model_state(path)
    else:
        checkpoint = load_checkpoint(path)
        if use_ema and "ema_state" in checkpoint:
            checkpoint = checkpoint["ema_state"]
        state = unwrap_state_dict(checkpoint)
    ours = model.state_dict()
    missing = [k for k in ours if k not in state]
    if allow_missing_head:
        missing = [k for k in missing if not k.startswith("head.")]
    unexpected = [k for k in state if k not in ours]
    wrong = [k for k in ours if k in state and state[k].shape != ours[k].shape]
    if missing or unexpected or wrong:
        what = (
            f"lacks {missing[0]}"
            if missing
            else f"has unknown tensor {unexpected[0]}"
            if unexpected
            else f"has {wrong[0]} of shape {tuple(state[wrong[0]].shape)}, "
            f"the model expects {tuple(ours[wrong[0]].shape)}"
        )
        raise CheckpointError(f"checkpoint {path} does not fit this model: it {what}")
    model.load_state_dict(state, strict=not allow_missing_head)
