"""The sweep config: a YAML file in pycls's sweep schema (NAME, ROOT_DIR, SETUP,
LAUNCH, ANALYZE), loaded into a frozen CfgNode and checked before any work starts.

    sweep = load_sweep_cfg("configs/sweeps/digits_lr_depth.yaml")
    sweep_dir(sweep)          # ROOT_DIR/NAME: cfgs/, logs/, cfgs.json, sweep.json

docs/SWEEPS.md documents every key; DEFAULTS below is the schema.
"""

import copy
import difflib
import os
from collections.abc import Mapping
from typing import Any

import yaml
from yacs.config import CfgNode

from pycls_fast.config import read_yaml, unknown_key, yaml_where
from pycls_fast.errors import ConfigError
from pycls_fast.sweep import constraints
from pycls_fast.sweep.samplers import load_sampler

DEFAULTS: dict[str, Any] = {
    # Sweep name: the folder under ROOT_DIR that holds everything of the sweep
    "NAME": "",
    # One-line description shown in the analysis page
    "DESC": "",
    # Folder holding sweeps (relative paths are relative to the current folder)
    "ROOT_DIR": "out/sweeps",
    "SETUP": {
        # Base config of every fork: a config file, or a mapping of config keys
        "BASE_CFG": "",
        # Keys set on every fork over BASE_CFG: {KEY: VALUE} (e.g. OPTIM.MAX_EPOCH: 5)
        "BASE_OPTS": {},
        # Forks to write; 0: one per point of the grid samplers
        "NUM_CONFIGS": 0,
        # Samples drawn at most to find NUM_CONFIGS valid, distinct forks
        "NUM_SAMPLES": 10000,
        # Seed of the sampler: the same seed writes the same forks
        "RNG_SEED": 0,
        # {KEY: sampler} (see pycls_fast/sweep/samplers.py)
        "SAMPLERS": {},
        # Keys computed from others: {KEY: expression}, e.g.
        # VIT.MLP_DIM: 3 * VIT.HIDDEN_DIM
        "DERIVED": {},
        "CONSTRAINTS": {
            # [LOW, HIGH] of the model's complexity; 0 leaves that end open
            "CX": {"FLOPS": [0, 0], "PARAMS": [0, 0], "ACTS": [0, 0]},
            # Expressions every fork must satisfy (see pycls_fast/sweep/constraints.py)
            "EXPRS": [],
        },
    },
    "LAUNCH": {
        # Backend: 'local' (train_net subprocesses on this machine); 'slurm' or
        # 'submitit_local': each run is a job of train_net's LAUNCH.MODE of that name
        # (docs/DISTRIBUTED.md), submitted and waited for by a subprocess here
        "MODE": "local",
        # Runs at once (submitted jobs in the queue or running, with slurm)
        "PARALLEL_JOBS": 1,
        # The runs' job resources (slurm, submitit_local): train_net's LAUNCH keys
        "NUM_GPUS": 1,
        "CPUS_PER_GPU": 10,
        "MEM_PER_GPU": 60,
        "PARTITION": "",
        "GPU_TYPE": "",
        "TIME_LIMIT": 4200,
        "COMMENT": "",
        "MAX_RETRY": 3,
        "CPU_ONLY": False,
    },
    "ANALYZE": {
        # Keys to plot the error against besides the swept ones (e.g. TRAIN.BATCH_SIZE)
        "METRICS": [],
        # Training curves of the best N runs
        "PLOT_CURVES_BEST": 3,
    },
}

LAUNCH_MODES = ("local", "slurm", "submitit_local")
# Free-form mappings: their keys are config keys, not schema keys.
_FREE = {"SETUP.BASE_OPTS", "SETUP.SAMPLERS", "SETUP.DERIVED"}


def _flat(node: Mapping, prefix: str = "") -> list[str]:
    out = []
    for k, v in node.items():
        key = f"{prefix}{k}"
        free = key in _FREE
        out.extend(_flat(v, key + ".") if isinstance(v, dict) and not free else [key])
    return out


def _merge(into: dict, src: Mapping, prefix: str = "") -> None:
    for k, v in src.items():
        key = f"{prefix}{k}"
        if k not in into:
            close = difflib.get_close_matches(key, _flat(DEFAULTS), n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ConfigError(f"unknown sweep config key {key}{hint}")
        default = into[k]
        if key == "SETUP.BASE_CFG":
            if not isinstance(v, str | dict):
                raise ConfigError(f"{key} must be a config file or a mapping of keys")
            into[k] = v
        elif isinstance(default, dict) and key not in _FREE:
            if not isinstance(v, dict):
                raise ConfigError(f"sweep config key {key}: expected a section")
            _merge(default, v, key + ".")
        else:
            into[k] = _coerce(key, v, default)


def _coerce(key: str, value: Any, default: Any) -> Any:
    if isinstance(default, bool) or default is None:
        ok = isinstance(value, type(default))
    elif isinstance(default, float):
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif isinstance(default, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif isinstance(default, list):
        ok = isinstance(value, list)
    else:
        ok = isinstance(value, type(default))
    if not ok:
        want = type(default).__name__
        raise ConfigError(f"sweep config key {key}: expected {want}, got {value!r}")
    return value


def _to_node(d: Mapping) -> CfgNode:
    # Free-form mappings keep their dotted keys: store them as plain dicts.
    node = CfgNode()
    for k, v in d.items():
        node[k] = _to_node(v) if isinstance(v, dict) and k not in _FREE_LEAVES else v
    return node


_FREE_LEAVES = {"BASE_OPTS", "SAMPLERS", "DERIVED", "BASE_CFG"}


def load_sweep_cfg(path: str) -> CfgNode:
    """Loads and checks the sweep config at `path`; returns a frozen CfgNode whose
    SETUP.SAMPLERS hold loaded samplers and SWEEP_CFG_FILE the file's absolute path.
    Raises ConfigError with one line naming the key or the file."""
    if not os.path.isfile(path):
        raise ConfigError(f"sweep config not found: {path}")
    try:
        with open(path) as f:
            src = read_yaml(f) or {}
    except yaml.YAMLError as e:
        raise ConfigError(
            f"sweep config {path} is not valid YAML{yaml_where(e)}"
        ) from None
    if not isinstance(src, dict):
        raise ConfigError(f"sweep config {path} must hold a mapping of keys")
    raw = copy.deepcopy(DEFAULTS)
    _merge(raw, src)
    _check(raw)
    setup = raw["SETUP"]
    setup["SAMPLERS"] = {k: load_sampler(k, s) for k, s in setup["SAMPLERS"].items()}
    raw["SWEEP_CFG_FILE"] = os.path.abspath(path)
    node = _to_node(raw)
    node.freeze()
    return node


def _check(raw: dict) -> None:
    if not raw["NAME"]:
        raise ConfigError("sweep config key NAME must be set (the sweep's folder name)")
    setup = raw["SETUP"]
    if not setup["BASE_CFG"]:
        raise ConfigError("sweep config key SETUP.BASE_CFG must be set")
    if not setup["SAMPLERS"]:
        raise ConfigError("sweep config key SETUP.SAMPLERS must name at least one key")
    for key in ("SETUP.NUM_CONFIGS", "SETUP.NUM_SAMPLES", "LAUNCH.PARALLEL_JOBS"):
        section, leaf = key.split(".")
        minimum = 0 if leaf == "NUM_CONFIGS" else 1
        if raw[section][leaf] < minimum:
            raise ConfigError(f"sweep config key {key} must be >= {minimum}")
    for name, bounds in setup["CONSTRAINTS"]["CX"].items():
        if len(bounds) != 2:
            raise ConfigError(f"SETUP.CONSTRAINTS.CX.{name} must be [LOW, HIGH]")
    for text in setup["CONSTRAINTS"]["EXPRS"] + list(setup["DERIVED"].values()):
        constraints.parse_expr(str(text))
    _check_metrics(raw["ANALYZE"]["METRICS"])
    if raw["LAUNCH"]["MODE"] not in LAUNCH_MODES:
        raise ConfigError(
            f"LAUNCH.MODE {raw['LAUNCH']['MODE']!r} is not implemented yet: only "
            f"{list(LAUNCH_MODES)} (docs/SWEEPS.md says how to add a backend)"
        )


def _check_metrics(metrics: list) -> None:
    """ANALYZE.METRICS must be training config keys (the error is plotted against
    each): a typo is refused with the closest key, as the config's errors do."""
    for key in metrics:
        if why := unknown_key(str(key)):
            raise ConfigError(f"ANALYZE.METRICS: {why}")


def sweep_dir(sweep: CfgNode) -> str:
    """The sweep's folder, ROOT_DIR/NAME, as an absolute path."""
    return os.path.abspath(os.path.join(sweep.ROOT_DIR, sweep.NAME))
