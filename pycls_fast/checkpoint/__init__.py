"""Checkpointing, one component: when to save, what, and how.

    files.py      names, listing, atomic writes, safe (weights_only) loading
    sharded.py    FSDP checkpoints with torch.distributed.checkpoint (DCP)
    state.py      Stateful parts and the RNG states
    cadence.py    when to save (pure functions)
    retention.py  which checkpoints to keep, the best pointer
    weights.py    TRAIN.WEIGHTS / TEST.WEIGHTS into a model
    manager.py    CheckpointManager: the trainer's one entry point

A checkpoint holds everything a resumed run needs to continue bit-for-bit on a CPU:
model, EMA, optimizer, master weights (O2), loss scaler, RNG states and the loader
position (epoch, iteration), plus the config it was made with.
"""

from pycls_fast.checkpoint.files import (
    checkpoint_dir,
    checkpoint_name,
    is_sharded,
    last_checkpoint,
    list_checkpoints,
    load_checkpoint,
    remove_partial,
    save_atomically,
    save_checkpoint,
)
from pycls_fast.checkpoint.manager import CheckpointManager
from pycls_fast.checkpoint.weights import load_model_weights
from pycls_fast.errors import CheckpointError

__all__ = [
    "CheckpointError",
    "CheckpointManager",
    "checkpoint_dir",
    "checkpoint_name",
    "is_sharded",
    "last_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "load_model_weights",
    "remove_partial",
    "save_atomically",
    "save_checkpoint",
]
