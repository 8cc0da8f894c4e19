"""Loading a checkpoint's weights into a model (TRAIN.WEIGHTS, TEST.WEIGHTS)."""

import logging
import math
import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field

import torch
import yaml
from yacs.config import CfgNode

from pycls_fast.checkpoint.files import is_sharded, load_checkpoint, resolve_weights
from pycls_fast.checkpoint.sharded import CheckpointTensors, read_meta
from pycls_fast.config import with_overrides
from pycls_fast.errors import CheckpointError, UserError
from pycls_fast.models.pycls_compat import is_pycls_main
from pycls_fast.models.timm_compat import unwrap_state_dict
from pycls_fast.parallel.materialize import copy_full_tensors

logger = logging.getLogger(__name__)

HEAD = "head."
RESET_HINT = "set TRAIN.RESET_HEAD True to re-initialise the classifier"


@dataclass
class LoadedWeights:
    """What load_model_weights put into the model, for the log line."""

    path: str
    matched: int
    total: int
    ema: bool = False
    # Tensors left as the model initialised them (a reset or absent head).
    reinitialised: list[str] = field(default_factory=list)
    # Training position of the checkpoint (completed epochs, iterations into the
    # next one); None for weights that do not carry it (converted timm files).
    epoch: int | None = None
    iteration: int = 0
    # Why these weights of the checkpoint were chosen, when a rule chose them.
    why: str = ""
    # What was adapted on the way in (a position embedding of another grid).
    notes: list[str] = field(default_factory=list)

    def describe(self) -> str:
        """One line: file, which weights, tensors matched, what was re-initialised."""
        which = "EMA weights" if self.ema else "model weights"
        line = f"loaded {which} of {self.path}: {self.matched}/{self.total} tensors"
        if self.why:
            line += f" ({self.why})"
        if self.reinitialised:
            line += f"; re-initialised {', '.join(self.reinitialised)}"
        for note in self.notes:
            line += f"; {note}"
        return line

    def unfinished(self, max_epoch: int) -> bool:
        """Whether the weights are of a run that had not finished: taken during an
        epoch, or after an epoch before the last (`max_epoch`)."""
        return self.epoch is not None and (self.iteration > 0 or self.epoch < max_epoch)

    def summary(self, max_epoch: int) -> str:
        """One line: which weights of which file, and where in training they were
        taken ("epoch E/MAX" after E completed epochs, "during epoch E/MAX" for a
        mid-epoch checkpoint), saying so when the run had not finished."""
        which = "EMA weights" if self.ema else "model weights"
        if self.epoch is None:
            return f"{which} of {self.path} (they do not say their epoch)"
        if self.iteration:
            where = (
                f"taken during epoch {self.epoch + 1}/{max_epoch}, at iteration "
                f"{self.iteration}"
            )
        else:
            where = f"epoch {self.epoch}/{max_epoch}"
        if self.unfinished(max_epoch):
            where += ": the run had not finished"
        return f"{which} of {self.path} ({where})"


POS = "pos_embedding"


def _grid(seq_len: int) -> tuple[int, int]:
    """(grid side, prefix tokens) of a position embedding of `seq_len` tokens: a square
    grid of patches after 0 (pooled classifier), 1 (class token) or 2 (and DeiT's
    distillation token) prefix tokens."""
    side = math.isqrt(seq_len)
    return side, seq_len - side * side


def resample_pos_embedding(state: dict, ours: dict) -> str | None:
    """Interpolates state's position embedding (1, seq, hidden) to the model's grid
    in place (bicubic, timm's `resample_abs_pos_embed`, as timm and DeiT fine-tune at a
    new resolution); returns a note, or None when nothing was done."""
    if POS not in state or POS not in ours:
        return None
    old, new = state[POS], ours[POS]
    if old.shape == new.shape or old.dim() != 3 or old.shape[2] != new.shape[2]:
        return None
    (g_old, prefix_old), (g_new, prefix_new) = _grid(old.shape[1]), _grid(new.shape[1])
    if prefix_old != prefix_new or prefix_old > 2:
        return None  # another classifier type: _misfit names the shapes
    from timm.layers import resample_abs_pos_embed

    state[POS] = resample_abs_pos_embed(
        old.float(), [g_new, g_new], num_prefix_tokens=prefix_new
    ).to(old.dtype)
    return f"position embedding resampled {g_old}x{g_old} -> {g_new}x{g_new} (bicubic)"


def _misfit(state: dict, ours: dict, allow_missing_head: bool, reset_head: bool):
    """What first keeps `state` from fitting a model of state dict `ours`, or None."""
    missing = [k for k in ours if k not in state]
    if allow_missing_head or reset_head:
        missing = [k for k in missing if not k.startswith(HEAD)]
    if missing:
        return f"lacks {missing[0]}"
    unexpected = [k for k in state if k not in ours]
    if unexpected:
        return f"has unknown tensor {unexpected[0]}"
    wrong = [k for k in ours if k in state and state.shape(k) != ours[k].shape]
    if wrong:
        text = (
            f"has {wrong[0]} of shape {tuple(state.shape(wrong[0]))}, "
            f"the model expects {tuple(ours[wrong[0]].shape)}"
        )
        if allow_missing_head and wrong[0].startswith(HEAD):
            text += f" (another class count: {RESET_HINT})"
        return text
    return None


def describe_misfits(state: dict, ours: dict, most: int = 3) -> list[str]:
    """The first `most` tensors that keep `state` from fitting a model of state dict
    `ours`, in words: shapes that differ, then missing and unknown names."""
    wrong = [k for k in ours if k in state and state[k].shape != ours[k].shape]
    lines = [
        f"{k} is {tuple(state[k].shape)} in the checkpoint, {tuple(ours[k].shape)} "
        "in the model"
        for k in wrong[:most]
    ]
    missing = [k for k in ours if k not in state]
    unexpected = [k for k in state if k not in ours]
    if missing:
        lines.append(f"the checkpoint lacks {', '.join(missing[:most])}")
    if unexpected:
        lines.append(f"the model has no {', '.join(unexpected[:most])}")
    return lines


def is_pycls_checkpoint(checkpoint) -> bool:
    """Whether a loaded checkpoint file was written by pycls (its trainer's
    {epoch, model_state, [ema_state], optimizer_state, test_err, ema_err, cfg}, or
    pycls main's ViT names), not by pycls_fast (whose training checkpoints carry
    scaler_state) or converted from timm."""
    if not isinstance(checkpoint, dict) or "model_state" not in checkpoint:
        return False
    if "scaler_state" in checkpoint:
        return False
    pycls_keys = "test_err" in checkpoint or "ema_err" in checkpoint
    return pycls_keys or is_pycls_main(checkpoint["model_state"])


def _pycls_choice(checkpoint: dict) -> tuple[str, str]:
    """pycls's test_model rule (pycls/core/checkpoint.py load_checkpoint without an
    EMA model): the model weights unless the EMA's test error was lower."""
    test_err = checkpoint.get("test_err", 100)
    ema_err = checkpoint.get("ema_err", 100)
    if "ema_state" in checkpoint and ema_err < test_err:
        return "ema_state", f"pycls's rule: EMA top-1 err {ema_err} < {test_err}"
    if "ema_state" in checkpoint:
        return "model_state", f"pycls's rule: top-1 err {test_err} <= EMA {ema_err}"
    return "model_state", ""


def no_ema(path: str) -> str:
    """The refusal of EMA weights that a checkpoint does not hold."""
    return (
        f"checkpoint {path} holds no EMA weights (its run kept none: OPTIM.EMA_ALPHA "
        "0); take its model weights (TEST.USE_EMA False, export without --ema, "
        "load_trained without ema=True)"
    )


def _read(path: str, use_ema: bool):
    """(state, whether it is the EMA's, meta dict, why) of a checkpoint; `state`
    maps names to full tensors that are read when taken (a sharded checkpoint's
    one by one, a file's memory-mapped), not all at once."""
    if is_sharded(path):
        # The checkpoint's index is read once, not once per tensor.
        model = CheckpointTensors(path)
        ema = CheckpointTensors(path, "ema", model.reader) if use_ema else {}
        if use_ema and not ema:
            raise CheckpointError(no_ema(path))
        return ema or model, bool(ema), model.meta(), ""
    checkpoint = load_checkpoint(path, mmap=True)
    meta = checkpoint if isinstance(checkpoint, dict) else {}
    if use_ema and "ema_state" in meta:
        return checkpoint["ema_state"], True, meta, ""
    if use_ema:
        raise CheckpointError(no_ema(path))
    if is_pycls_checkpoint(checkpoint):
        key, why = _pycls_choice(checkpoint)
        chosen = {"model_state": checkpoint[key]}
        return unwrap_state_dict(chosen), key == "ema_state", meta, why
    return unwrap_state_dict(checkpoint), False, meta, ""


class _Tensors(MutableMapping):
    """A checkpoint's tensors by name with what loading changes on the way in (a
    resampled position embedding, a dropped head), none read until taken."""

    def __init__(self, source: Mapping) -> None:
        self._source, self._set, self._dropped = source, {}, set()

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self._set and hasattr(self._source, "shape"):
            return self._source.shape(name)
        return tuple(self[name].shape)

    def __getitem__(self, name):
        if name in self._dropped:
            raise KeyError(name)
        return self._set[name] if name in self._set else self._source[name]

    def __setitem__(self, name, value):
        self._dropped.discard(name)
        self._set[name] = value

    def __delitem__(self, name):
        if name not in self:
            raise KeyError(name)
        self._set.pop(name, None)
        self._dropped.add(name)

    def __contains__(self, name):
        return name not in self._dropped and (name in self._set or name in self._source)

    def __iter__(self):
        seen = [k for k in self._source if k not in self._dropped]
        return iter(seen + [k for k in self._set if k not in self._source])

    def __len__(self):
        return sum(1 for _ in self)


def checkpoint_channel_order(path: str) -> tuple[str, str] | None:
    """The channel order the weights of a checkpoint expect, with the reason: 'bgr'
    for pycls's checkpoints (pycls's loader feeds BGR), the saved config's
    DATA.CHANNEL_ORDER for pycls_fast's; None when the checkpoint does not say."""
    if is_sharded(path):
        cfg_text = read_meta(path).get("cfg")
    else:
        checkpoint = load_checkpoint(path)
        if is_pycls_checkpoint(checkpoint):
            return "bgr", "a pycls checkpoint: pycls's ImageNet loader feeds BGR"
        cfg_text = checkpoint.get("cfg") if isinstance(checkpoint, dict) else None
    try:
        saved = yaml.safe_load(cfg_text) if isinstance(cfg_text, str) else None
        order = saved["DATA"]["CHANNEL_ORDER"]
    except (yaml.YAMLError, KeyError, TypeError):
        return None
    if order in ("rgb", "bgr"):
        return order, "the order its training used"
    return None


def load_model_weights(
    model: torch.nn.Module,
    path: str,
    *,
    allow_missing_head=False,
    use_ema=False,
    reset_head=False,
    reference: dict[str, torch.Tensor] | None = None,
) -> LoadedWeights:
    """Loads model weights (the EMA weights with `use_ema`, when the checkpoint has
    them) from a checkpoint file or sharded checkpoint directory into `model`, whole
    or already sharded (each rank keeps its pieces: parallel/materialize.py; one
    full tensor at a time, never the whole model); names the file on mismatch. A
    position embedding trained at another image size (or patch grid) is
    interpolated to this model's grid. `allow_missing_head`: head.* tensors may be
    absent (TRAIN.WEIGHTS); `reset_head`: head.* tensors of another shape are
    skipped too, leaving the model's fresh classifier (TRAIN.RESET_HEAD).
    `reference`: the whole model's state dict (meta tensors will do) when `model`
    holds only some of it (a pipeline stage); default: `model`'s own."""
    source, ema, meta, why = _read(path, use_ema)
    ours = reference if reference is not None else model.state_dict()
    state = _Tensors(source)
    note = resample_pos_embedding(state, ours)
    reset = []
    if reset_head:
        reset = [
            k
            for k in ours
            if k.startswith(HEAD) and k in state and state.shape(k) != ours[k].shape
        ]
        for k in reset:
            del state[k]
    what = _misfit(state, ours, allow_missing_head, reset_head)
    if what:
        raise CheckpointError(f"checkpoint {path} does not fit this model: it {what}")
    # Each tensor read (or paged in) when its turn comes, this rank's piece kept.
    copy_full_tensors(model, lambda name, t: state.get(name))
    epoch = meta.get("epoch")
    return LoadedWeights(
        path=path,
        matched=sum(1 for k in ours if k in state),
        total=len(ours),
        ema=ema,
        reinitialised=[k for k in ours if k not in state],
        epoch=epoch if isinstance(epoch, int) else None,
        iteration=int(meta.get("iter") or 0),
        why=why,
        notes=[note] if note else [],
    )


TEST_WEIGHTS_EMPTY = (
    "TEST.WEIGHTS is empty: name the checkpoint to evaluate, or evaluate a run's "
    "newest checkpoint with --run OUT_DIR"
)


def resolve_weights_key(cfg: CfgNode, key: str) -> tuple[str, str]:
    """resolve_weights of the path that the config key `key` (TRAIN.WEIGHTS,
    TEST.WEIGHTS) holds; its CheckpointError names the key."""
    section, name = key.split(".")
    try:
        return resolve_weights(cfg[section][name])
    except CheckpointError as e:
        raise CheckpointError(f"{key}: {e}") from None


def check_weights(cfg: CfgNode, train: bool) -> None:
    """Checks, once before any rank starts (as check_data checks DATA.PATH), that
    the weights the run reads exist: TRAIN.WEIGHTS when set and the teacher's
    (`train`), else TEST.WEIGHTS, which an evaluation needs. A UserError naming
    the key, instead of every rank failing on it."""
    if train:
        if cfg.TRAIN.WEIGHTS:
            resolve_weights_key(cfg, "TRAIN.WEIGHTS")
        teacher = cfg.DISTILL.TEACHER_WEIGHTS
        if cfg.DISTILL.TYPE != "none" and not os.path.isfile(teacher):
            raise CheckpointError(
                f"DISTILL.TEACHER_WEIGHTS: checkpoint not found: {teacher} (a "
                "checkpoint file: pycls_fast's, pycls's or timm's)"
            )
        return
    if not cfg.TEST.WEIGHTS:
        raise UserError(TEST_WEIGHTS_EMPTY)
    resolve_weights_key(cfg, "TEST.WEIGHTS")


def resolve_start_weights(cfg: CfgNode) -> CfgNode:
    """`cfg` with TRAIN.WEIGHTS made the checkpoint it names: a run or checkpoints
    folder becomes its newest complete checkpoint (as TEST.WEIGHTS), logged; the
    run's config.yaml then records the file it started from."""
    if not cfg.TRAIN.WEIGHTS:
        return cfg
    path, how = resolve_weights_key(cfg, "TRAIN.WEIGHTS")
    if how == "given":
        return cfg
    logger.info("TRAIN.WEIGHTS %s: %s", cfg.TRAIN.WEIGHTS, how)
    return with_overrides(cfg, {"TRAIN.WEIGHTS": path})
