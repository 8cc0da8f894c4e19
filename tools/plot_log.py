#!/usr/bin/env python3
"""Plots training curves from json_stats logs: loss, top-1 / top-5 errors, lr, img/s.

    python tools/plot_log.py RUN [RUN ...] [--out FILE.png]

RUN is a run folder (OUT_DIR) or its log file (OUT_DIR/stdout.log). With one run the
figure goes to OUT_DIR/plots.png; with several runs they are overlaid (one colour
each, labelled by folder) and the figure goes to --out (default: plots.png in the
current folder). A dotted vertical line marks where a run resumed.
"""

import os

from pycls_fast.launch.cli import ArgumentParser, run
from pycls_fast.observe.plots import plot_runs, read_run


def main():
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="run folders (OUT_DIR) or log files")
    parser.add_argument("--out", help="PNG to write")
    args = parser.parse_args()
    runs = [read_run(path) for path in args.runs]
    if args.out:
        out = args.out
    elif len(runs) == 1:
        out = os.path.join(os.path.dirname(runs[0].log), "plots.png")
    else:
        out = "plots.png"
    print(f"wrote {plot_runs(runs, out)}")


if __name__ == "__main__":
    run(main)
