"""test_net's evaluations: TEST.WEIGHTS at several resolutions (TEST.SIZES), on
several test sets (TEST.SPLIT + TEST.EXTRA_SPLITS: ImageNet-V2, -Sketch, and -A / -R,
whose 200 classes are read from the logits masked to them: test_sets.py), and with
ImageNet-ReaL labels (TEST.REAL_LABELS), in one run.

Each (size, split) is one `test_epoch` record with `im_size`, `split` and `classes`
fields (`subset` for a named class subset, `real_top1_err` for the main split with
ReaL labels); `evaluate` returns them in order, `write_report` keeps them beside the
log as one JSON file per checkpoint.
At another size the model is built at that size and the weights loaded into it, so
the position embedding is interpolated (checkpoint/weights.py); the resize before
the center crop keeps the config's crop ratio (TRAIN.IM_SIZE / TEST.IM_SIZE).
"""

import json
import logging
import os
import re

import torch
from yacs.config import CfgNode

from pycls_fast.config import with_overrides
from pycls_fast.engine.lifecycle import checkpoint_epoch_label, prepare_test
from pycls_fast.engine.model_setup import build_components
from pycls_fast.engine.step import (
    eval_forward,
    pad_sharded_forwards,
    planned_forwards,
)
from pycls_fast.engine.test_sets import split_classes
from pycls_fast.engine.trainer import test_epoch
from pycls_fast.errors import UserError
from pycls_fast.runtime import distributed

logger = logging.getLogger(__name__)

_VAL_NUMBER = re.compile(r"ILSVRC2012_val_(\d+)")


def at_size(cfg: CfgNode, size: int) -> CfgNode:
    """`cfg` evaluated at crop `size`, the resize scaled to keep the crop ratio."""
    if size == cfg.TRAIN.IM_SIZE:
        return cfg
    resize = round(size * cfg.TEST.IM_SIZE / cfg.TRAIN.IM_SIZE)
    return with_overrides(cfg, {"TRAIN.IM_SIZE": size, "TEST.IM_SIZE": resize})


def load_real_labels(path: str) -> list[list[int]]:
    """ImageNet-ReaL's real.json: for validation image k (ILSVRC2012_val_0000k+1), the
    list of its plausible labels (empty: left out of ReaL accuracy)."""
    try:
        with open(path) as f:
            real = json.load(f)
    except (OSError, ValueError) as e:
        raise UserError(f"TEST.REAL_LABELS {path}: cannot read it ({e})") from None
    if not isinstance(real, list) or not all(isinstance(r, list) for r in real):
        raise UserError(f"TEST.REAL_LABELS {path}: expected a list of label lists")
    return real


def real_top1_err(parts, model, real: list[list[int]]) -> tuple[float, int]:
    """(top-1 error % under ReaL labels, images counted) of `model` on the test
    loader's images, all ranks together. Predictions are matched to images through
    the loader's plan, less the images it skipped as bad (known by path)."""
    loader = parts.test_loader
    index = loader.decoder.index
    plan = iter(loader.plan(0))
    correct, counted, forwards = 0, 0, 0
    size = parts.cfg.TEST.BATCH_SIZE // parts.layout.dp
    model.eval()
    loader.set_epoch(0)
    most = planned_forwards(parts)
    for images, _ in loader:
        bad = {path for path, _ in loader.bad_images}
        for batch in plan:  # a batch of only bad images was not yielded
            good = [int(i) for i in batch if index.path(int(i)) not in bad]
            if good:
                break
        inputs, _ = parts.test_prep(images, torch.zeros(len(images), dtype=torch.long))
        # test_epoch's path: through the pipeline under PP (logits on the last
        # stage only), and as many forwards on every rank under FSDP (below).
        with torch.no_grad(), parts.autocast():
            logits = eval_forward(parts, model, inputs, size)
        forwards += 1
        if logits is None or not parts.reports_metrics:
            continue  # another rank of this replica counts these images
        preds = logits.argmax(dim=1).tolist()
        for i, pred in zip(good, preds, strict=True):
            match = _VAL_NUMBER.search(os.path.basename(index.path(i)))
            if match is None:
                raise UserError(
                    f"TEST.REAL_LABELS: {index.path(i)} is not named "
                    "ILSVRC2012_val_<number> (ReaL labels are by validation file)"
                )
            labels = real[int(match.group(1)) - 1]
            if labels:
                counted += 1
                correct += pred in labels
    with torch.no_grad():
        pad_sharded_forwards(parts, model, forwards, most)
    correct, counted = distributed.all_reduce_sum([correct, counted])
    return 100.0 * (1.0 - correct / max(counted, 1)), int(counted)


def evaluate(cfg: CfgNode, path: str) -> list[dict]:
    """Evaluates the checkpoint `path` at each TEST.SIZES on each test split; returns
    the records (the first: TRAIN.IM_SIZE or the first size, on TEST.SPLIT)."""
    sizes = list(cfg.TEST.SIZES) or [cfg.TRAIN.IM_SIZE]
    splits = [cfg.TEST.SPLIT, *cfg.TEST.EXTRA_SPLITS]
    real = load_real_labels(cfg.TEST.REAL_LABELS) if cfg.TEST.REAL_LABELS else None
    subsets = [split_classes(cfg, split) for split in splits]
    records = []
    for size in sizes:
        cfg_s = at_size(cfg, size)
        parts = build_components(
            cfg_s, loaders=(), weights=path, use_ema=cfg.TEST.USE_EMA
        )
        label = checkpoint_epoch_label(parts.loaded, cfg.OPTIM.MAX_EPOCH)
        if not records:
            logger.info("evaluating %s", parts.loaded.summary(cfg.OPTIM.MAX_EPOCH))
        for split, classes in zip(splits, subsets, strict=True):
            cfg_x = with_overrides(cfg_s, {"TEST.SPLIT": split})
            subset = classes.columns is not None
            parts.attach_test_loader(cfg_x, class_subset=subset)
            extra = {"im_size": size, "split": split, "classes": classes.count}
            if classes.name:
                extra["subset"] = classes.name
            if real is not None and split == cfg.TEST.SPLIT:
                err, n = real_top1_err(parts, parts.model, real)
                extra.update(real_top1_err=err, real_images=n)
            columns = None
            if subset:
                columns = torch.tensor(classes.columns, device=parts.device)
            record = test_epoch(
                parts, parts.model, 0, label=label, extra=extra, columns=columns
            )
            records.append(record)
    return records


def format_table(records: list[dict]) -> str:
    """The records as a text table: split (and the subset's name), classes, size,
    top-1, top-5 (and ReaL top-1)."""
    real = any("real_top1_err" in r for r in records)
    head = "| split | classes | size | top-1 | top-5 |"
    head += " ReaL top-1 |" if real else ""
    lines = [head, "|---|---|---|---|---|" + ("---|" if real else "")]
    for r in records:
        split = f"{r['split']} ({r['subset']})" if r.get("subset") else r["split"]
        row = (
            f"| {split} | {r.get('classes', '')} | {r['im_size']} | "
            f"{100 - r['top1_err']:.2f} | {100 - r['top5_err']:.2f} |"
        )
        if real:
            value = r.get("real_top1_err")
            row += f" {100 - value:.2f} |" if value is not None else " |"
        lines.append(row)
    return "\n".join(lines)


def report_path(out_dir: str, checkpoint: str, ema: bool = False) -> str:
    """OUT_DIR/eval_<checkpoint name>.json (eval_<name>_ema.json for its EMA
    weights): where the evaluation of `checkpoint` (a file or sharded directory)
    is kept."""
    name = os.path.splitext(os.path.basename(os.path.normpath(checkpoint)))[0]
    return os.path.join(out_dir, f"eval_{name}{'_ema' if ema else ''}.json")


def write_report(
    out_dir: str, checkpoint: str, records: list[dict], ema: bool = False
) -> str:
    """Writes the evaluation of `checkpoint` (its EMA weights with `ema`: its
    records and their table) to report_path (atomically); returns the path."""
    path = report_path(out_dir, checkpoint, ema)
    os.makedirs(out_dir, exist_ok=True)
    report = {
        "checkpoint": os.path.abspath(checkpoint),
        "ema": ema,
        "epoch": records[0]["epoch"] if records else None,
        "records": records,
        "table": format_table(records),
    }
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1)
    os.replace(tmp, path)
    return path


def read_report(out_dir: str, checkpoint: str, ema: bool = False) -> dict | None:
    """The report write_report wrote for `checkpoint` (its EMA weights with `ema`)
    under `out_dir`, or None."""
    try:
        with open(report_path(out_dir, checkpoint, ema)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def needs_evaluate(cfg: CfgNode) -> bool:
    """Whether test_net needs `evaluate` rather than one test_epoch: several sizes or
    splits, ReaL labels, or a test split of some of the model's classes."""
    if cfg.TEST.SIZES or cfg.TEST.EXTRA_SPLITS or cfg.TEST.REAL_LABELS:
        return True
    return split_classes(cfg, cfg.TEST.SPLIT).columns is not None


def evaluate_model(cfg: CfgNode) -> list[dict]:
    """test_net's entry point on every rank: sets up the run as test_model does and
    returns `evaluate`'s records."""
    cfg, path = prepare_test(cfg)
    return evaluate(cfg, path)
