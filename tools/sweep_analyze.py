#!/usr/bin/env python3
"""Analyzes a collected sweep: python tools/sweep_analyze.py --sweep-cfg FILE

Writes figures (error vs complexity, vs each swept key, the best runs' curves, the
error EDF) and ROOT_DIR/NAME/analysis/index.html, one page with the figures and a
sortable table of the runs."""

from pycls_fast.launch.cli import ArgumentParser, run
from pycls_fast.sweep.config import load_sweep_cfg
from pycls_fast.sweep.report import analyze_sweep


def main():
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep-cfg", required=True, help="sweep config file")
    args = parser.parse_args()
    print(f"wrote {analyze_sweep(load_sweep_cfg(args.sweep_cfg))}")


if __name__ == "__main__":
    run(main)
