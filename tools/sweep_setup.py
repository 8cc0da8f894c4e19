#!/usr/bin/env python3
"""Sets up a sweep: python tools/sweep_setup.py --sweep-cfg FILE

Samples the sweep's config forks (reproducible from SETUP.RNG_SEED) and writes them
to ROOT_DIR/NAME/cfgs/<run>.yaml, listed with their overrides and complexity in
ROOT_DIR/NAME/cfgs.json (docs/SWEEPS.md)."""

import os

from pycls_fast.launch.cli import ArgumentParser, run
from pycls_fast.sweep.config import load_sweep_cfg, sweep_dir
from pycls_fast.sweep.setup import FORKS_FILE, setup_sweep


def main():
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep-cfg", required=True, help="sweep config file")
    args = parser.parse_args()
    sweep = load_sweep_cfg(args.sweep_cfg)
    runs = setup_sweep(sweep)
    for r in runs:
        values = ", ".join(f"{k}={v}" for k, v in r["overrides"].items())
        cx = r["complexity"]
        print(
            f"{r['name']}: {values} ({cx['flops'] / 1e6:.1f} MFLOPs, "
            f"{cx['params'] / 1e6:.2f} M params)"
        )
    print(f"wrote {len(runs)} forks: {os.path.join(sweep_dir(sweep), FORKS_FILE)}")


if __name__ == "__main__":
    run(main)
