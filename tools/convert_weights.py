#!/usr/bin/env python3
"""Converts ViT weights between timm's VisionTransformer and pycls_fast.

    # timm -> ours (to fine-tune: TRAIN.WEIGHTS out.pyth)
    python tools/convert_weights.py --cfg configs/vit/ViT-B-16.yaml \\
        --src vit_base.pth --dst vit_base.pyth [--drop-head] [KEY VALUE ...]
    # ours -> timm
    python tools/convert_weights.py --cfg ... --src ckpt.pyth --dst timm.pth --to-timm

--src may be a .pth/.pt/.pyth torch file or a .safetensors file; a checkpoint holding
the weights under 'model_state', 'state_dict' or 'model' is unwrapped. Our output is a
checkpoint {'model_state': ..., 'cfg': ...}; timm output is a plain state dict.
"""

import os

import torch

from pycls_fast.checkpoint.files import save_atomically
from pycls_fast.errors import UserError
from pycls_fast.launch.cli import cfg_from_args, config_parser, run
from pycls_fast.models import build_model
from pycls_fast.models.timm_compat import from_timm, to_timm


def load_weights(path):
    """Loads a state dict (or checkpoint dict) from a torch or safetensors file."""
    if not os.path.isfile(path):
        raise UserError(f"--src: no such file: {path}")
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise UserError(
            f"--src: {path} is not a readable torch checkpoint ({e})"
        ) from None


def main():
    parser = config_parser("Convert ViT weights between timm and pycls_fast.")
    parser.add_argument("--src", required=True, help="input weights file")
    parser.add_argument("--dst", required=True, help="output weights file")
    parser.add_argument(
        "--to-timm",
        action="store_true",
        help="convert ours -> timm (default: timm -> ours)",
    )
    parser.add_argument(
        "--drop-head",
        action="store_true",
        help="leave out the classifier (timm -> ours)",
    )
    args = parser.parse_args()
    cfg = cfg_from_args(args)
    weights = load_weights(args.src)
    os.makedirs(os.path.dirname(os.path.abspath(args.dst)), exist_ok=True)
    if os.path.abspath(args.src) == os.path.abspath(args.dst):
        raise UserError(
            "--dst must differ from --src (the source is never overwritten)"
        )
    if args.to_timm:
        out = to_timm(weights, cfg)
        save_atomically(out, args.dst)
    else:
        state = from_timm(weights, cfg, drop_head=args.drop_head)
        # Load into the model, so a mismatch fails here and not at training time.
        build_model(cfg).load_state_dict(state, strict=not args.drop_head)
        save_atomically({"model_state": state, "cfg": cfg.dump()}, args.dst)
    print(f"wrote {args.dst} ({len(out if args.to_timm else state)} tensors)")


if __name__ == "__main__":
    run(main)
