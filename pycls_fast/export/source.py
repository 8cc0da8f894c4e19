"""What tools/export.py exports: a checkpoint, the config it was trained with, and
the model (fp32, CPU, eval mode) holding its weights, with test_net's evaluation of
that checkpoint when there is one."""

import os
import tempfile
from dataclasses import dataclass

from torch import nn
from yacs.config import CfgNode

from pycls_fast.checkpoint.files import is_sharded, load_checkpoint, resolve_weights
from pycls_fast.checkpoint.sharded import read_meta
from pycls_fast.checkpoint.weights import (
    LoadedWeights,
    checkpoint_channel_order,
    load_model_weights,
)
from pycls_fast.config import load_cfg
from pycls_fast.engine.evaluation import read_report
from pycls_fast.errors import ConfigError, UserError
from pycls_fast.launch.cli import EVAL_DIR
from pycls_fast.models import build_model


@dataclass
class ExportSource:
    """A checkpoint ready to export: its config, the fp32 CPU model in eval mode
    with its weights, what was loaded, and test_net's report (or None)."""

    cfg: CfgNode
    checkpoint: str
    model: nn.Module
    loaded: LoadedWeights
    evaluation: dict | None


def saved_config(checkpoint: str, opts=()) -> CfgNode:
    """The config a pycls_fast checkpoint (file or sharded directory) was written
    with, KEY VALUE `opts` applied; UserError when it carries none."""
    if is_sharded(checkpoint):
        text = read_meta(checkpoint).get("cfg")
    else:
        saved = load_checkpoint(checkpoint)
        text = saved.get("cfg") if isinstance(saved, dict) else None
    if not isinstance(text, str):
        raise UserError(
            f"{checkpoint} carries no config: give the one it was trained with, --cfg"
        )
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        f.write(text)
        f.flush()
        return load_cfg(f.name, list(opts))


def find_evaluation(
    checkpoint: str, run_dir: str | None, ema: bool = False
) -> dict | None:
    """test_net's report of `checkpoint` (of its EMA weights with `ema`): in the
    run's eval/ folder, or in an eval/ folder beside the checkpoint or its
    checkpoints/ folder."""
    folder = os.path.dirname(os.path.abspath(checkpoint))
    places = [os.path.join(run_dir, EVAL_DIR)] if run_dir else []
    places += [os.path.join(folder, EVAL_DIR), os.path.join(folder, "..", EVAL_DIR)]
    places += [folder]
    for place in places:
        report = read_report(place, checkpoint, ema)
        if report is not None:
            return report
    return None


def check_rgb(cfg: CfgNode, checkpoint: str) -> None:
    """ConfigError for weights trained on BGR input (pycls's loader): exports are
    read by tools that feed RGB."""
    order = cfg.DATA.CHANNEL_ORDER
    if order == "auto":
        found = checkpoint_channel_order(checkpoint)
        order = found[0] if found else "rgb"
    if order == "bgr":
        raise ConfigError(
            f"{checkpoint} expects BGR input (DATA.CHANNEL_ORDER): timm and ONNX "
            "exports are fed RGB; fine-tune it on RGB first"
        )


def load_source(
    cfg: CfgNode, weights: str, run_dir: str | None = None, use_ema: bool = False
) -> ExportSource:
    """The checkpoint `weights` names (a file, a sharded directory or a run folder's
    newest) loaded into `cfg`'s model (its EMA weights with `use_ema`)."""
    checkpoint = resolve_weights(weights)[0]
    check_rgb(cfg, checkpoint)
    model = build_model(cfg)
    loaded = load_model_weights(model, checkpoint, use_ema=use_ema)
    model.float().eval()
    return ExportSource(
        cfg, checkpoint, model, loaded, find_evaluation(checkpoint, run_dir, use_ema)
    )
