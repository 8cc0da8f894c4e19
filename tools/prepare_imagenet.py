#!/usr/bin/env python3
"""Prepares ImageNet-1k from the official archives (docs/DATA.md, "From the archives").

    python tools/prepare_imagenet.py --archives /downloads --out /datasets/imagenet

`--archives` holds ILSVRC2012_img_train.tar, ILSVRC2012_img_val.tar and
ILSVRC2012_devkit_t12.tar.gz (or name each with --train-tar, --val-tar, --devkit).
Writes OUT/train/<wnid>/*.JPEG and OUT/val/<wnid>/*.JPEG, the layout train_net reads.
Interrupted, it continues where it stopped when run again. For network file systems
or object stores, pack the result into shards next: tools/pack_dataset.py.
"""

import os

from pycls_fast.datasets.formats import prepare
from pycls_fast.datasets.formats.index import load_index
from pycls_fast.datasets.formats.progress import progress_printer
from pycls_fast.errors import UserError
from pycls_fast.launch.cli import ArgumentParser, run


def main():
    parser = ArgumentParser(
        description=__doc__.split("\n")[0],
        epilog="Then: tools/pack_dataset.py --data OUT --out SHARDS for shards.",
    )
    parser.add_argument("--archives", default=".", help="folder of the archives")
    parser.add_argument("--train-tar", help=f"default: ARCHIVES/{prepare.TRAIN_TAR}")
    parser.add_argument("--val-tar", help=f"default: ARCHIVES/{prepare.VAL_TAR}")
    parser.add_argument("--devkit", help=f"default: ARCHIVES/{prepare.DEVKIT}")
    parser.add_argument("--out", required=True, help="dataset root to write")
    parser.add_argument("--splits", nargs="+", default=["train", "val"])
    parser.add_argument(
        "--no-md5", action="store_true", help="accept a devkit whose MD5 differs"
    )
    args = parser.parse_args()
    unknown = set(args.splits) - {"train", "val"}
    if unknown:
        raise UserError(f"--splits: train and/or val, not {' '.join(sorted(unknown))}")
    named = {
        "train": args.train_tar or os.path.join(args.archives, prepare.TRAIN_TAR),
        "val": args.val_tar or os.path.join(args.archives, prepare.VAL_TAR),
        "devkit": args.devkit or os.path.join(args.archives, prepare.DEVKIT),
    }
    needed = [*args.splits, *(["devkit"] if "val" in args.splits else [])]
    for key in needed:  # every archive checked before hours of extraction start
        if not os.path.isfile(named[key]):
            raise UserError(f"archive not found: {named[key]}")
    try:
        os.makedirs(args.out, exist_ok=True)
    except OSError as e:
        raise UserError(f"--out {args.out} cannot be created: {e.strerror}") from None
    if not os.access(args.out, os.W_OK):
        raise UserError(f"--out {args.out} is not writable")
    if "train" in args.splits:
        n = prepare.extract_train(
            named["train"], args.out, progress_printer("train", "class")
        )
        print(f"train: {n} classes extracted now")
    if "val" in args.splits:
        _, val_wnids = prepare.parse_devkit(named["devkit"], not args.no_md5)
        n = prepare.extract_val(
            named["val"], args.out, val_wnids, progress_printer("val", "image")
        )
        print(f"val: {n} images written now")
    classes = None
    for split in args.splits:
        index = load_index(args.out, split)
        if classes is not None and index.classes != classes:
            raise UserError(f"{args.out}: train and val have different classes")
        classes = index.classes
        print(f"{split}: {len(index.classes)} classes, {len(index)} images")


if __name__ == "__main__":
    run(main)
