#!/usr/bin/env python3
"""Builds the demo dataset: python tools/prepare_digits.py [--root data/digits]."""

from pycls_fast.datasets.formats.digits import build_digits_folder
from pycls_fast.launch.cli import ArgumentParser, run


def main():
    parser = ArgumentParser(description=__doc__.split(":")[0])
    parser.add_argument("--root", default="data/digits", help="output folder")
    parser.add_argument("--size", type=int, default=32, help="image side in pixels")
    args = parser.parse_args()
    counts = build_digits_folder(args.root, args.size)
    print(
        f"{args.root}: {counts['train']} train, {counts['val']} val images, 10 classes"
    )


if __name__ == "__main__":
    run(main)
