"""Samplers of config values (pycls's sweep samplers, plus a grid).

A sampler is a mapping from the sweep config's SETUP.SAMPLERS, e.g.

    OPTIM.BASE_LR: {TYPE: float_sampler, RAND_TYPE: log_uniform,
                    RANGE: [1.0e-4, 1.0e-2], QUANTIZE: 1.0e-6}
    VIT.NUM_LAYERS: {TYPE: grid_sampler, VALUES: [2, 4, 6]}

TYPE is one of: value_sampler (one of VALUES, uniformly), grid_sampler (every one of
VALUES: the sweep enumerates the product of its grid samplers), float_sampler and
int_sampler (RAND_TYPE in RANGE = [LOW, HIGH], closed, quantized to QUANTIZE) and
list_sampler (LENGTH values, each from ITEM_SAMPLER).
"""

import itertools
from collections.abc import Mapping
from typing import Any

import numpy as np

from pycls_fast.errors import ConfigError
from pycls_fast.sweep import rand

# Each type's fields and their defaults (pycls's SAMPLERS templates).
TEMPLATES: dict[str, dict[str, Any]] = {
    "value_sampler": {"VALUES": []},
    "grid_sampler": {"VALUES": []},
    "float_sampler": {"RAND_TYPE": "uniform", "RANGE": [0.0, 0.0], "QUANTIZE": 1e-5},
    "int_sampler": {"RAND_TYPE": "uniform", "RANGE": [0, 0], "QUANTIZE": 1},
    "list_sampler": {"LENGTH": 0, "ITEM_SAMPLER": None},
}


def load_sampler(key: str, raw: Any) -> dict[str, Any]:
    """The sampler of `key` with its type's defaults filled in and checked; a bare
    list is a grid (`KEY: [a, b]` means grid_sampler over a, b). ConfigError names
    the key."""
    if isinstance(raw, list):
        raw = {"TYPE": "grid_sampler", "VALUES": raw}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"sampler of {key} must be a mapping with TYPE, got {raw!r}")
    kind = str(raw.get("TYPE", "")).lower()
    if kind not in TEMPLATES:
        raise ConfigError(
            f"sampler of {key}: TYPE must be one of {list(TEMPLATES)}, got {kind!r}"
        )
    unknown = set(raw) - set(TEMPLATES[kind]) - {"TYPE"}
    if unknown:
        raise ConfigError(f"sampler of {key}: unknown field(s) {sorted(unknown)}")
    sampler = {**TEMPLATES[kind], **raw, "TYPE": kind}
    if kind in ("value_sampler", "grid_sampler"):
        if not isinstance(sampler["VALUES"], list) or not sampler["VALUES"]:
            raise ConfigError(f"sampler of {key}: VALUES must be a non-empty list")
    elif kind == "list_sampler":
        if not isinstance(sampler["LENGTH"], int) or sampler["LENGTH"] < 1:
            raise ConfigError(f"sampler of {key}: LENGTH must be an int >= 1")
        item = load_sampler(key, sampler["ITEM_SAMPLER"])
        if item["TYPE"] == "grid_sampler":
            raise ConfigError(f"sampler of {key}: ITEM_SAMPLER cannot be a grid")
        sampler["ITEM_SAMPLER"] = item
    else:
        cast = int if kind == "int_sampler" else float
        try:
            low, high = (cast(v) for v in sampler["RANGE"])
            q = cast(sampler["QUANTIZE"])
        except (TypeError, ValueError):
            raise ConfigError(
                f"sampler of {key}: RANGE must be [LOW, HIGH] and QUANTIZE a number"
            ) from None
        rand.check_rand(key, sampler["RAND_TYPE"], low, high, q)
        sampler["RANGE"], sampler["QUANTIZE"] = [low, high], q
    return sampler


def sample(sampler: Mapping[str, Any], rng: np.random.Generator) -> Any:
    """One value drawn by a (loaded) non-grid sampler."""
    kind = sampler["TYPE"]
    if kind == "value_sampler":
        return sampler["VALUES"][int(rng.integers(len(sampler["VALUES"])))]
    if kind == "list_sampler":
        return [sample(sampler["ITEM_SAMPLER"], rng) for _ in range(sampler["LENGTH"])]
    low, high = sampler["RANGE"]
    value = rand.RAND_TYPES[sampler["RAND_TYPE"]](rng, low, high, sampler["QUANTIZE"])
    return int(value) if kind == "int_sampler" else float(value)


def grid(samplers: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Every combination of the grid samplers' values, in order ([{}] when none)."""
    keys = [k for k, s in samplers.items() if s["TYPE"] == "grid_sampler"]
    values = [samplers[k]["VALUES"] for k in keys]
    return [dict(zip(keys, combo, strict=True)) for combo in itertools.product(*values)]


def draw(
    samplers: Mapping[str, Mapping[str, Any]],
    grid_point: Mapping[str, Any],
    rng: np.random.Generator,
) -> dict[str, Any]:
    """One sample {key: value}: the grid point's values and a draw of every other
    sampler, in the samplers' order."""
    return {
        key: grid_point[key] if s["TYPE"] == "grid_sampler" else sample(s, rng)
        for key, s in samplers.items()
    }


def is_log_scale(sampler: Mapping[str, Any]) -> bool:
    """Whether a sampler's values are best plotted on a log axis."""
    if sampler["TYPE"] in ("float_sampler", "int_sampler"):
        return sampler["RAND_TYPE"] not in ("uniform", "normal")
    values = sampler.get("VALUES") or []
    numbers = [v for v in values if isinstance(v, int | float) and v > 0]
    return len(numbers) == len(values) > 1 and max(numbers) / min(numbers) >= 10
