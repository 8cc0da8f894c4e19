#!/usr/bin/env python3
"""Writes docs/CONFIG.md from the key declarations of pycls_fast/config.py.

    python tools/gen_config_doc.py [--check]

With --check, exits 1 if docs/CONFIG.md is out of date (tests run this).
"""

import os

from pycls_fast.config_doc import render
from pycls_fast.launch.cli import ArgumentParser, run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "CONFIG.md")


def main():
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="fail if out of date")
    args = parser.parse_args()
    text = render()
    if args.check:
        current = ""
        if os.path.exists(DOC):
            with open(DOC) as f:
                current = f.read()
        if current != text:
            print("docs/CONFIG.md is out of date: run tools/gen_config_doc.py")
            return 1
        return 0
    with open(DOC, "w") as f:
        f.write(text)
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    run(main)
