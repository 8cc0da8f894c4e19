"""A run's record stays true: the config a rerun brings against the one its
checkpoints were trained with.

    changes = check_rerun(cfg)   # before any rank starts: refuses, in one line, a
                                 # change that alters what the checkpoints mean
    record_config(cfg)           # rank 0, once training starts: config.yaml written,
                                 # the one it replaces kept in config_history/

Each checkpoint stores the config it was trained with (`cfg`). A rerun into its
OUT_DIR may change keys that do not alter what the checkpoints mean (`SAFE`: logging,
evaluation batch, loader, launch, checkpoint cadence, layout); any other change is
refused unless named in TRAIN.ACCEPT_CHANGES, and OPTIM.MAX_EPOCH's refusal states
what the new schedule does to the learning rate.
"""

import logging
import os

import torch
import yaml
from yacs.config import CfgNode

import pycls_fast.checkpoint.files as files
import pycls_fast.checkpoint.sharded as sharded
from pycls_fast.components.optimizer import lr_at
from pycls_fast.errors import UserError
from pycls_fast.storage import is_remote

logger = logging.getLogger(__name__)

# Keys (or nodes, ending in ".") whose change leaves the meaning of a run's
# checkpoints as it was: how the run is logged, loaded, launched, laid out on the
# devices, checkpointed and evaluated in passing.
SAFE = (
    "DESC", "VERBOSE", "LOG_PERIOD", "LOG_DEST", "LOG_TENSORBOARD", "CFG_DEST",
    "OUT_DIR", "OUT_MIRROR", "NUM_GPUS", "MAX_GPUS_PER_NODE", "HOST", "PORT",
    "PORT_RANGE", "DIST_BACKEND", "DOWNLOAD_CACHE", "DIST.", "LAUNCH.", "PROF.",
    "PREC_TIME.", "CUDNN.", "MEM.", "DATA_LOADER.", "PARALLEL.", "DATA.PATH",
    "DATA.INDEX_CACHE", "FSDP.RESHARD_AFTER_FW", "FSDP.ACTIVATION_CHECKPOINT",
    "AMP.TF32", "TEST.BATCH_SIZE", "TEST.WEIGHTS", "TEST.USE_EMA", "TEST.SIZES",
    "TEST.EXTRA_SPLITS", "TEST.REAL_LABELS", "TRAIN.AUTO_RESUME", "TRAIN.WEIGHTS",
    "TRAIN.RESET_HEAD", "TRAIN.EVAL_PERIOD", "TRAIN.CHECKPOINT_PERIOD",
    "TRAIN.CHECKPOINT_ITER_PERIOD", "TRAIN.CHECKPOINT_KEEP",
    "TRAIN.CHECKPOINT_KEEP_BEST", "TRAIN.PREEMPT_CHECK_PERIOD", "TRAIN.COMPILE",
    "TRAIN.CUDA_GRAPHS", "AMP.FP8_EMULATE",
    "TRAIN.ACCEPT_CHANGES", "FSDP.ENABLED", "TRAIN.CHECKPOINT_ASYNC", "LOG_WANDB",
    "WANDB.", "MFU.",
)  # fmt: skip

HISTORY_DIR = "config_history"


def is_safe(key: str) -> bool:
    """Whether changing `key` leaves the meaning of a run's checkpoints unchanged."""
    return any(key == s or (s.endswith(".") and key.startswith(s)) for s in SAFE)


def _flat(node, prefix: str = "") -> dict:
    out = {}
    for k, v in node.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _as_flat(cfg_or_text) -> dict:
    """{dotted key: value} of a config or of its YAML dump (values as YAML reads
    them, so that both sides of a comparison have the same types)."""
    text = cfg_or_text if isinstance(cfg_or_text, str) else cfg_or_text.dump()
    return _flat(yaml.safe_load(text) or {})


def differing_keys(old, new) -> list[tuple[str, object, object]]:
    """[(key, old value, new value)] of the keys that differ between two configs
    (CfgNodes or their YAML dumps), in the new config's order."""
    a, b = _as_flat(old), _as_flat(new)
    # 'auto' (DATA.CHANNEL_ORDER) is resolved when training starts: the saved
    # config holds what it became.
    return [(k, a.get(k), v) for k, v in b.items() if a.get(k) != v and v != "auto"]


def saved_config_text(path: str) -> str | None:
    """The config a checkpoint file or sharded directory was trained with (its YAML
    dump), or None when it holds none."""
    if files.is_sharded(path):
        text = sharded.read_meta(path).get("cfg")
    else:
        try:  # memory-mapped: the tensors are not read, only the small values
            checkpoint = torch.load(path, map_location="cpu", weights_only=True,
                                    mmap=True)  # fmt: skip
        except Exception:  # noqa: BLE001 - an old or odd file: read it whole
            checkpoint = files.load_checkpoint(path)
        text = checkpoint.get("cfg") if isinstance(checkpoint, dict) else None
    return text if isinstance(text, str) else None


def accepted_keys(cfg: CfgNode) -> list[str]:
    """The keys TRAIN.ACCEPT_CHANGES names (comma-separated; 'all' for every key)."""
    return [k.strip() for k in cfg.TRAIN.ACCEPT_CHANGES.split(",") if k.strip()]


def _fmt(value) -> str:
    return repr(value) if isinstance(value, str) else str(value)


def schedule_note(old_text: str, cfg: CfgNode, epoch: float) -> str:
    """What a new OPTIM.MAX_EPOCH does to the learning rate of a run resumed at
    `epoch` (completed epochs): the rate there on both schedules."""
    old = CfgNode.load_cfg(old_text)
    was, now = lr_at(old, epoch), lr_at(cfg, epoch)
    return (
        f"the {cfg.OPTIM.LR_POLICY} schedule is recomputed over "
        f"{cfg.OPTIM.MAX_EPOCH} epochs: at epoch {epoch:g} the lr becomes {now:.3g}, "
        f"where the {old.OPTIM.MAX_EPOCH}-epoch schedule had {was:.3g}"
    )


def describe_changes(changes, old_text: str, cfg: CfgNode, epoch: float) -> str:
    """The changes in words: "KEY old -> new, ..." (MAX_EPOCH with its schedule)."""
    parts = []
    for key, a, b in changes:
        text = f"{key} {_fmt(a)} -> {_fmt(b)}"
        if key == "OPTIM.MAX_EPOCH":
            text += f" ({schedule_note(old_text, cfg, epoch)})"
        parts.append(text)
    return ", ".join(parts)


def compare_with_run(cfg: CfgNode) -> tuple[str | None, list[str]]:
    """`cfg` against the config of the newest checkpoint in OUT_DIR (local OUT_DIRs;
    without TRAIN.AUTO_RESUME, a checkpoint there is refused): (the refusal in one
    line, or None; the accepted and safe changes in words, a line each for the log)."""
    if is_remote(cfg.OUT_DIR):
        return None, []
    last = files.last_checkpoint(cfg.OUT_DIR)
    if last and not cfg.TRAIN.AUTO_RESUME:
        # Training anew would write its checkpoints and epoch_stats.csv over the
        # run's: nothing already written is lost.
        return (
            f"OUT_DIR {cfg.OUT_DIR} holds a run's checkpoints (newest "
            f"{os.path.basename(last)}), which TRAIN.AUTO_RESUME False would train "
            "over: start a new OUT_DIR, or drop TRAIN.AUTO_RESUME False to resume it"
        ), []
    if not cfg.TRAIN.AUTO_RESUME:
        return None, []
    text = saved_config_text(last) if last else None
    if text is None:
        return None, []
    epoch = (files.position(last) or (0, 0))[0]
    changes = differing_keys(text, cfg)
    meaningful = [c for c in changes if not is_safe(c[0])]
    accepted = accepted_keys(cfg)
    refused = [c for c in meaningful if c[0] not in accepted and "all" not in accepted]
    if refused:
        keys = ",".join(k for k, _, _ in refused)
        return (
            f"OUT_DIR {cfg.OUT_DIR} holds a run trained with another config "
            f"({os.path.basename(last)}): "
            f"{describe_changes(refused, text, cfg, epoch)}; start a new OUT_DIR, or "
            f"accept the change explicitly with TRAIN.ACCEPT_CHANGES {keys}"
        ), []
    notes = []
    if meaningful:
        described = describe_changes(meaningful, text, cfg, epoch)
        notes.append(f"accepted config change (TRAIN.ACCEPT_CHANGES): {described}")
    safe = [c for c in changes if is_safe(c[0])]
    if safe:
        described = describe_changes(safe, text, cfg, epoch)
        notes.append(f"config change that leaves the checkpoints' meaning: {described}")
    return None, notes


def check_rerun(cfg: CfgNode) -> list[str]:
    """UserError, in one line naming the keys, when `cfg` changes what the
    checkpoints in OUT_DIR mean (keys outside `SAFE` not in TRAIN.ACCEPT_CHANGES);
    else the changes in words (see `compare_with_run`)."""
    refusal, notes = compare_with_run(cfg)
    if refusal:
        raise UserError(refusal)
    return notes


def record_config(cfg: CfgNode) -> str:
    """Writes OUT_DIR/config.yaml (rank 0, once the run has restored its checkpoint
    and before it writes one). When it replaces a different config, that one is kept
    as OUT_DIR/config_history/NNN.yaml and the changes are logged. Returns the path
    written."""
    notes = compare_with_run(cfg)[1]
    path = os.path.join(cfg.OUT_DIR, cfg.CFG_DEST)
    new = cfg.dump()
    if os.path.isfile(path):
        with open(path) as f:
            old = f.read()
        changes = differing_keys(old, new)
        if changes:
            folder = os.path.join(cfg.OUT_DIR, HISTORY_DIR)
            os.makedirs(folder, exist_ok=True)
            kept = os.path.join(folder, f"{len(os.listdir(folder)) + 1:03d}.yaml")
            os.replace(path, kept)
            keys = ", ".join(k for k, _, _ in changes)
            logger.info("config changed (%s); the previous one is %s", keys, kept)
    for note in notes:
        logger.info("%s", note)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(new)
    os.replace(tmp, path)
    return path
