"""Loading a checkpoint's weights into a model (TRAIN.WEIGHTS, TEST.WEIGHTS)."""

import torch

from pycls_fast.core.checkpoint.files import is_sharded, load_checkpoint
from pycls_fast.core.checkpoint.sharded import read_model_state
from pycls_fast.errors import CheckpointError
from pycls_fast.models.timm_compat import unwrap_state_dict


def _misfit(state: dict, ours: dict, allow_missing_head: bool):
    """What first keeps `state` from fitting a model of state dict `ours`, or None."""
    missing = [k for k in ours if k not in state]
    if allow_missing_head:
        missing = [k for k in missing if not k.startswith("head.")]
    if missing:
        return f"lacks {missing[0]}"
    unexpected = [k for k in state if k not in ours]
    if unexpected:
        return f"has unknown tensor {unexpected[0]}"
    wrong = [k for k in ours if k in state and state[k].shape != ours[k].shape]
    if wrong:
        return (
            f"has {wrong[0]} of shape {tuple(state[wrong[0]].shape)}, "
            f"the model expects {tuple(ours[wrong[0]].shape)}"
        )
    return None


def load_model_weights(
    model: torch.nn.Module, path: str, *, allow_missing_head=False, use_ema=False
) -> None:
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
    what = _misfit(state, model.state_dict(), allow_missing_head)
    if what:
        raise CheckpointError(f"checkpoint {path} does not fit this model: it {what}")
    model.load_state_dict(state, strict=not allow_missing_head)
