#!/usr/bin/env python3
"""Packs folder splits into tar shards for DATA.FORMAT shards (docs/DATA.md, "Shards").

    python tools/pack_dataset.py --data /datasets/imagenet --out /nfs/imagenet_shards
    python tools/pack_dataset.py --data /datasets/imagenet --out s3://bucket/imagenet

Reads DATA_PATH/<split>/<class>/<image> and writes OUT/<split>/<split>-NNNNNN.tar
(WebDataset naming: <class>/<key>.jpeg + <class>/<key>.cls) with index.npz and
shards.json. Rerunning after an interruption keeps the finished shards. A URL output
needs its fsspec package (s3fs for s3://).
"""

from pycls_fast.datasets.formats.index import load_index
from pycls_fast.datasets.formats.pack import pack_split
from pycls_fast.datasets.formats.progress import progress_printer
from pycls_fast.errors import UserError
from pycls_fast.launch.cli import ArgumentParser, run


def main():
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", required=True, help="folder dataset root")
    parser.add_argument("--out", required=True, help="output root: a path or URL")
    parser.add_argument("--splits", nargs="+", default=["train", "val"])
    parser.add_argument(
        "--shard-mb", type=float, default=256, help="image bytes per shard (MB)"
    )
    parser.add_argument("--seed", type=int, default=0, help="image order seed")
    args = parser.parse_args()
    if args.shard_mb <= 0:
        raise UserError(f"--shard-mb must be positive, got {args.shard_mb}")
    classes = None
    for split in args.splits:
        index = load_index(args.data, split)
        if classes is not None and index.classes != classes:
            raise UserError(
                f"class folders of {index.split_dir} differ from those of "
                f"{args.splits[0]}: labels would not mean the same"
            )
        classes = index.classes
        meta = pack_split(
            index,
            args.out,
            split,
            int(args.shard_mb * 2**20),
            args.seed,
            progress_printer(f"packing {split}", "image"),
        )
        print(
            f"{split}: {meta['images']} images, {len(meta['classes'])} classes, "
            f"{len(meta['shards'])} shards in {args.out}"
        )


if __name__ == "__main__":
    run(main)
