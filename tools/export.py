#!/usr/bin/env python3
"""Exports a checkpoint for timm or ONNX runtimes, with a model card.

    python tools/export.py --run OUT_DIR [--best] --format safetensors --dst DIR
    python tools/export.py --weights FILE [--cfg FILE] --format onnx --dst DIR
    python tools/export.py --run OUT_DIR --format onnx --dst NAME.onnx

--run OUT_DIR: the run's config.yaml and its newest complete checkpoint (the best
with --best); --weights FILE: a checkpoint file, sharded directory or run folder,
with the config it carries (or --cfg FILE). KEY VALUE pairs override config keys.
--ema exports the EMA weights.

safetensors: DIR/model.safetensors with timm's parameter names and DIR/config.json
(timm's own), so that `timm.create_model("local-dir:DIR", pretrained=True)` builds
timm's VisionTransformer with these weights, offline; checked here: timm's logits
equal the model's (within float32 rounding).
onnx: DIR/model.onnx (torch's exporter; batch dimension symbolic, or --batch N
fixed), checked with onnxruntime on the CPU: its logits equal the model's within a
tolerance derived from float32 and the model's reductions (export/onnx_format.py).

Both write DIR/README.md: the config, test_net's table when the checkpoint was
evaluated (OUT_DIR/eval/eval_<checkpoint>.json), the complexity, and the inference
throughput measured here at --batch-sizes (--no-throughput to skip).
A --dst ending in the format's suffix (NAME.onnx, NAME.safetensors) is the file
itself: the model card goes beside it as NAME.md (and timm's config as NAME.json).
"""

import os

import torch

from pycls_fast.checkpoint.files import resolve_weights
from pycls_fast.engine import inference
from pycls_fast.engine.trainer import checkpoint_epoch_label
from pycls_fast.errors import ConfigError, UserError
from pycls_fast.export import model_card, onnx_format, timm_format
from pycls_fast.export.source import load_source, saved_config
from pycls_fast.launch.cli import cfg_from_args, config_parser, run
from pycls_fast.runtime import distributed

FORMATS = ("safetensors", "onnx")
SUFFIXES = {"safetensors": ".safetensors", "onnx": ".onnx"}


def _parser():
    parser = config_parser("Export a checkpoint for timm or ONNX.", run=True, best=True)
    parser.add_argument("--weights", help="checkpoint file, sharded dir or run folder")
    parser.add_argument("--format", required=True, choices=FORMATS)
    parser.add_argument(
        "--dst",
        required=True,
        help="folder to write the export to, or the file (NAME.onnx, NAME.safetensors)",
    )
    parser.add_argument("--ema", action="store_true", help="the EMA weights")
    parser.add_argument(
        "--batch", type=int, help="onnx: a fixed batch size (default: any)"
    )
    parser.add_argument(
        "--batch-sizes", default="1,32", help="throughput: batch sizes to time"
    )
    parser.add_argument(
        "--no-throughput", action="store_true", help="do not time inference"
    )
    return parser


def _config(args):
    """(config, weights to export)."""
    if args.weights and args.run:
        raise UserError("give --run OUT_DIR or --weights FILE, not both")
    if not (args.weights or args.run):
        raise UserError("give --run OUT_DIR or --weights FILE")
    if args.run:
        cfg = cfg_from_args(args)
        return cfg, cfg.TEST.WEIGHTS
    if not os.path.exists(args.weights):
        raise UserError(f"--weights: not found: {args.weights}")
    if args.cfg_file:
        return cfg_from_args(args), args.weights
    return saved_config(resolve_weights(args.weights)[0], args.opts), args.weights


def _destination(args):
    """(folder, stem) of --dst: a path ending in the format's suffix names the
    export's file (stem: its name less the suffix; the card beside it), any other
    a folder (stem None) holding the format's files and README.md."""
    suffix = SUFFIXES[args.format]
    for fmt, other in SUFFIXES.items():
        if fmt != args.format and args.dst.endswith(other):
            raise UserError(
                f"--dst {args.dst}: a {other} file, but --format {args.format}"
            )
    if args.dst.endswith(suffix) and os.path.basename(args.dst) != suffix:
        name = os.path.basename(args.dst)[: -len(suffix)]
        return os.path.dirname(args.dst) or ".", name
    if os.path.isfile(args.dst):
        raise UserError(f"--dst {args.dst} is a file: name a folder or a {suffix} file")
    return args.dst, None


def _batch_sizes(args):
    """The throughput batch sizes (None: --no-throughput), checked before any work."""
    if args.no_throughput:
        return None
    try:
        sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise UserError(
            f"--batch-sizes: expected sizes >= 1 like 1,32: {args.batch_sizes}"
        )
    return sizes


def _throughput(cfg, sizes):
    if sizes is None:
        return None
    device = distributed.device()
    try:
        models = inference.build_models(cfg, device)
    except ConfigError:  # no timm peer for this shape: ours alone
        models = inference.build_models(cfg, device, timm_peer=False)
    return inference.measure_inference(cfg, models, sizes, device, rounds=3)


def _export(source, args, dst, stem):
    """Writes the export into the folder `dst` (the files named `stem`, or the
    format's own names) and checks it; returns (files, check)."""
    cfg, model = source.cfg, source.model
    size = cfg.TRAIN.IM_SIZE
    if args.format == "safetensors":
        timm_format.export_timm(model, cfg, dst, stem)
        loaded = timm_format.load_timm(dst, stem)
        g = torch.Generator().manual_seed(0)
        images = torch.randn(3, 3, size, size, generator=g)
        diff, scale = timm_format.logit_difference(model, loaded, images)
        # The same float32 operations, in other orders (our layout, timm's).
        tol = onnx_format.logit_tolerance(cfg, scale)
        if diff > tol:
            raise onnx_format.ExportCheckError(
                f"timm's model from {dst} differs from ours by {diff:.3g} "
                f"(over {tol:.3g})"
            )
        weights, config = timm_format.export_files(stem)
        files = {"weights": weights, "config": config}
        what = "timm.create_model against pycls_fast"
        return files, {"what": what, "max_abs_diff": diff, "tolerance": tol}
    os.makedirs(dst, exist_ok=True)
    name = f"{stem or 'model'}.onnx"
    path = os.path.join(dst, name)
    onnx_format.export_onnx(model, cfg, path, args.batch)
    batches = [args.batch] if args.batch else [1, 3]
    check = onnx_format.check_onnx(path, model, cfg, batches)
    what = f"onnxruntime (CPU) against pycls_fast, batches {batches}"
    files = {"onnx": name}
    if os.path.exists(path + ".data"):  # weights over 2 GB, beside the graph
        files["onnx_data"] = f"{name}.data"
    return files, {**check, "what": what}


def main():
    args = _parser().parse_args()
    cfg, weights = _config(args)
    sizes = _batch_sizes(args)
    if args.batch is not None and args.batch < 1:
        raise UserError("--batch must be >= 1")
    dst, stem = _destination(args)
    if args.format == "safetensors":
        timm_format.timm_model_args(cfg)  # refused before any work
    else:
        onnx_format.check_onnx_packages()
    source = load_source(cfg, weights, run_dir=args.run, use_ema=args.ema)
    summary = source.loaded.summary(cfg.OPTIM.MAX_EPOCH)
    print(f"exporting {summary}", flush=True)
    files, check = _export(source, args, dst, stem)
    rows = _throughput(cfg, sizes)
    epoch = checkpoint_epoch_label(source.loaded, cfg.OPTIM.MAX_EPOCH)
    text = model_card.model_card(
        cfg,
        args.format,
        {
            "checkpoint": source.checkpoint,
            "epoch": epoch,
            "ema": source.loaded.ema,
            "summary": summary,
        },
        files,
        source.evaluation,
        rows,
        check,
    )
    card = model_card.write_model_card(dst, text, stem)
    print(
        f"wrote {', '.join(os.path.join(dst, f) for f in files.values())} and "
        f"{card}; {check['what']}: largest logit difference "
        f"{check['max_abs_diff']:.3g} (tolerance {check['tolerance']:.3g})"
    )


if __name__ == "__main__":
    run(main)
