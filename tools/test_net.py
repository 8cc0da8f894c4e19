#!/usr/bin/env python3
"""Evaluates weights: python tools/test_net.py --cfg FILE TEST.WEIGHTS CKPT [KEY VALUE]

    python tools/test_net.py --run OUT_DIR [--best] [KEY VALUE ...]

KEY VALUE pairs override config keys. TEST.WEIGHTS is a checkpoint file, a sharded
(FSDP) checkpoint directory, or a run or checkpoints folder (its newest complete
checkpoint). `--run OUT_DIR` evaluates a finished run: its config.yaml, its newest
complete checkpoint (the best with --best), the log in OUT_DIR/eval/. Runs under
torchrun or with NUM_GPUS N like train_net. TEST.SIZES, TEST.EXTRA_SPLITS and
TEST.REAL_LABELS evaluate at several resolutions, on more test sets (ImageNet-V2,
-Sketch, -A, -R: docs/RECIPES.md) and with ImageNet-ReaL labels in one run, and print a
table. The records and the table are also written to OUT_DIR/eval_<checkpoint>.json
(tools/export.py puts them in the model card)."""

from pycls_fast.checkpoint.files import resolve_weights
from pycls_fast.checkpoint.weights import check_weights
from pycls_fast.config import check_launch, with_overrides
from pycls_fast.datasets.images.transforms import build_transform
from pycls_fast.datasets.loader import check_data
from pycls_fast.engine.evaluation import (
    evaluate_model,
    format_table,
    needs_evaluate,
    write_report,
)
from pycls_fast.engine.trainer import test_model
from pycls_fast.launch.cli import (
    cfg_from_args,
    config_parser,
    evaluation_out_dir,
    run,
    without_wandb,
)
from pycls_fast.launch.submit import submit_or_launch
from pycls_fast.storage import is_remote


def _report(cfg, records):
    """Keeps the records beside the log (a local OUT_DIR), named by checkpoint
    (and whether its EMA weights were evaluated)."""
    if is_remote(cfg.OUT_DIR):
        return
    checkpoint = resolve_weights(cfg.TEST.WEIGHTS)[0]
    path = write_report(cfg.OUT_DIR, checkpoint, records, cfg.TEST.USE_EMA)
    print(f"evaluation written to {path}", flush=True)


def main():
    parser = config_parser(
        "Evaluate TEST.WEIGHTS on DATA.PATH/TEST.SPLIT.", run=True, best=True
    )
    cfg = without_wandb(evaluation_out_dir(cfg_from_args(parser.parse_args())))
    check_launch(cfg)  # what to run is refused before what to read
    build_transform(cfg, train=False)  # TEST.IM_SIZE against the crop
    check_data(cfg, ("test",))  # once, before any rank starts
    check_weights(cfg, train=False)  # TEST.WEIGHTS too
    for split in cfg.TEST.EXTRA_SPLITS:
        check_data(with_overrides(cfg, {"TEST.SPLIT": split}), ("test",))
    if needs_evaluate(cfg):
        records = submit_or_launch(evaluate_model, cfg)
        if records is not None:  # rank 0
            print(format_table(records), flush=True)
            _report(cfg, records)
        return
    record = submit_or_launch(test_model, cfg)
    if record is None:  # not rank 0
        return
    print(
        f"top-1 accuracy: {100.0 - record['top1_err']:.2f}%  "
        f"top-5 accuracy: {100.0 - record['top5_err']:.2f}%  "
        f"({record['images']} images, epoch {record['epoch']})",
        flush=True,
    )
    # As evaluate's records: the split, its size, its classes (all the model's).
    where = {"split": cfg.TEST.SPLIT, "im_size": cfg.TRAIN.IM_SIZE}
    _report(cfg, [{**record, **where, "classes": cfg.MODEL.NUM_CLASSES}])


if __name__ == "__main__":
    run(main)
