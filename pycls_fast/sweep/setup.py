"""Sweep setup: sample the forks of a sweep and write them.

    forks = setup_sweep(sweep)   # ROOT_DIR/NAME/cfgs/000000.yaml ..., cfgs.json

Each fork is a complete config (the base config, BASE_OPTS, the sampled values, the
DERIVED keys, OUT_DIR = ROOT_DIR/NAME/logs/<run>) that loads alone with load_cfg.
Sampling is sequential from one numpy Generator seeded by SETUP.RNG_SEED, so the same
sweep config writes the same forks. A sample is refused when its config is invalid,
breaks a constraint or repeats an earlier one; too few valid samples is a UserError
that says what refused them.
"""

import collections
import json
import os
import shutil
from collections.abc import Mapping
from typing import Any

import numpy as np
from yacs.config import CfgNode

from pycls_fast.config import load_cfg, unknown_key, with_overrides
from pycls_fast.errors import ConfigError, UserError
from pycls_fast.models import complexity
from pycls_fast.sweep import constraints, samplers
from pycls_fast.sweep.config import sweep_dir
from pycls_fast.sweep.runs import write_json

FORKS_FILE = "cfgs.json"


def run_name(index: int) -> str:
    """A run's name: its index on six digits, as pycls names its forks."""
    return f"{index:06d}"


def base_cfg(sweep: CfgNode) -> CfgNode:
    """The checked config every fork starts from: SETUP.BASE_CFG (a file or a mapping)
    with SETUP.BASE_OPTS applied."""
    base = sweep.SETUP.BASE_CFG
    if isinstance(base, str):
        cfg = load_cfg(base)
    else:
        flat = _flatten(base)
        cfg = with_overrides(load_cfg(None), flat) if flat else load_cfg(None)
    opts = dict(sweep.SETUP.BASE_OPTS)
    cfg = with_overrides(cfg, opts) if opts else cfg
    if cfg.DATA.PATH and not os.path.isabs(cfg.DATA.PATH):
        # Forks may run from another folder (a cluster job's): pin the data's path.
        cfg = with_overrides(cfg, {"DATA.PATH": os.path.abspath(cfg.DATA.PATH)})
    return cfg


def _flatten(node: Mapping, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in node.items():
        if isinstance(v, Mapping):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _derive(cfg: CfgNode, derived: Mapping[str, str]) -> dict[str, Any]:
    out = {}
    for key, text in derived.items():
        out[key] = constraints.evaluate(str(text), cfg, {})
        cfg = with_overrides(cfg, {key: out[key]})
    return out


def sample_forks(sweep: CfgNode) -> list[dict[str, Any]]:
    """The sweep's forks, in order: [{"overrides": {key: value}, "complexity": {...},
    "cfg": CfgNode}], without writing anything. Raises UserError when fewer than
    NUM_CONFIGS samples are valid after NUM_SAMPLES tries."""
    setup = sweep.SETUP
    for key in [*setup.SAMPLERS, *setup.DERIVED]:  # a typo, not a refused sample
        if why := unknown_key(key):
            raise ConfigError(f"SETUP.SAMPLERS / SETUP.DERIVED: {why}")
    base = base_cfg(sweep)
    grid = samplers.grid(setup.SAMPLERS)
    only_grid = all(s["TYPE"] == "grid_sampler" for s in setup.SAMPLERS.values())
    wanted = setup.NUM_CONFIGS or len(grid)
    tries = len(grid) if only_grid else setup.NUM_SAMPLES
    cx_ranges = {k: list(v) for k, v in setup.CONSTRAINTS.CX.items()}
    exprs = list(setup.CONSTRAINTS.EXPRS)
    rng = np.random.default_rng(setup.RNG_SEED)
    forks, seen, refused = [], set(), collections.Counter()
    for attempt in range(tries):
        if len(forks) == wanted:
            break
        values = samplers.draw(setup.SAMPLERS, grid[attempt % len(grid)], rng)
        key = json.dumps(values, sort_keys=True)
        if key in seen:
            refused["a repeat of an earlier sample"] += 1
            continue
        seen.add(key)
        try:
            cfg = with_overrides(base, values)
            derived = _derive(cfg, setup.DERIVED)
            cfg = with_overrides(cfg, derived) if derived else cfg
            cx = complexity(cfg)
            why = constraints.violation(cfg, cx, cx_ranges, exprs)
        except ConfigError as e:
            why = f"invalid config: {e}"
        if why:
            refused[why] += 1
            continue
        forks.append({"overrides": {**values, **derived}, "complexity": cx, "cfg": cfg})
    if len(forks) < wanted:
        reasons = "; ".join(f"{n} {why}" for why, n in refused.most_common(3))
        raise UserError(
            f"only {len(forks)} of SETUP.NUM_CONFIGS {wanted} forks are valid after "
            f"{attempt + 1} samples (refused: {reasons}): widen the samplers or the "
            "constraints, or raise SETUP.NUM_SAMPLES"
        )
    return forks


def setup_sweep(sweep: CfgNode) -> list[dict[str, Any]]:
    """Samples the forks and writes them: ROOT_DIR/NAME/cfgs/<run>.yaml, a copy of the
    sweep config (sweep_cfg.yaml) and cfgs.json listing each fork's run name, files,
    overrides and complexity; returns that list. Refuses (UserError) a sweep whose
    runs have started (ROOT_DIR/NAME/logs/ holds runs)."""
    root = sweep_dir(sweep)
    logs = os.path.join(root, "logs")
    if os.path.isdir(logs) and os.listdir(logs):
        raise UserError(
            f"sweep {root} has started (its logs/ folder holds runs): set it up again "
            "only after removing it, or give the sweep another NAME"
        )
    forks = sample_forks(sweep)
    cfgs_dir = os.path.join(root, "cfgs")
    shutil.rmtree(cfgs_dir, ignore_errors=True)
    os.makedirs(cfgs_dir)
    shutil.copyfile(sweep.SWEEP_CFG_FILE, os.path.join(root, "sweep_cfg.yaml"))
    runs = []
    for i, fork in enumerate(forks):
        name = run_name(i)
        out_dir = os.path.join(logs, name)
        cfg = with_overrides(fork["cfg"], {"OUT_DIR": out_dir})
        cfg_file = os.path.join(cfgs_dir, f"{name}.yaml")
        with open(cfg_file, "w") as f:
            f.write(cfg.dump())
        runs.append(
            {
                "index": i,
                "name": name,
                "cfg_file": cfg_file,
                "out_dir": out_dir,
                "overrides": fork["overrides"],
                "complexity": fork["complexity"],
            }
        )
    listing = {
        "name": sweep.NAME,
        "sweep_cfg": sweep.SWEEP_CFG_FILE,
        "rng_seed": sweep.SETUP.RNG_SEED,
        "swept_keys": list(sweep.SETUP.SAMPLERS) + list(sweep.SETUP.DERIVED),
        "runs": runs,
    }
    write_json(os.path.join(root, FORKS_FILE), listing)
    return runs


def load_forks(sweep: CfgNode) -> dict[str, Any]:
    """cfgs.json of a sweep that was set up; UserError when it was not."""
    path = os.path.join(sweep_dir(sweep), FORKS_FILE)
    if not os.path.isfile(path):
        raise UserError(
            f"{path} not found: set the sweep up first (tools/sweep_setup.py)"
        )
    with open(path) as f:
        return json.load(f)
