#!/usr/bin/env python3
"""Collects a sweep: python tools/sweep_collect.py --sweep-cfg FILE

Gathers each run's config, complexity, status (done / failed / incomplete / missing)
and json_stats into ROOT_DIR/NAME/sweep.json, and prints each run's status."""

import os

from pycls_fast.launch.cli import ArgumentParser, run
from pycls_fast.sweep.collect import SWEEP_FILE, collect_sweep
from pycls_fast.sweep.config import load_sweep_cfg, sweep_dir


def main():
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep-cfg", required=True, help="sweep config file")
    args = parser.parse_args()
    sweep = load_sweep_cfg(args.sweep_cfg)
    data = collect_sweep(sweep)
    for r in data["runs"]:
        s = r["summary"]
        err = f"top-1 err {s['top1_err']:.2f}%" if s["top1_err"] is not None else ""
        epochs = f"{s['epochs_done']}/{s['epochs_total'] or '?'} epochs"
        print(f"{r['name']} {r['status']:<10} {epochs:<12} {err} {r['error']}".rstrip())
    counts = ", ".join(f"{n} {k}" for k, n in sorted(data["counts"].items()))
    print(f"{counts}; wrote {os.path.join(sweep_dir(sweep), SWEEP_FILE)}")


if __name__ == "__main__":
    run(main)
