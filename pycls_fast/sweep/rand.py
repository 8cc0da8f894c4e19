"""Random values in the closed interval [low, high], quantized to q (pycls's
sweep/random.py, with an explicit numpy Generator instead of the global RNG, so a
sweep's samples depend on its seed only)."""

from collections.abc import Callable
from decimal import Decimal

import numpy as np

from pycls_fast.errors import ConfigError


def quantize(f: float, q: float, op: Callable[[float], float] = np.floor) -> float:
    """f rounded by `op` to a multiple of q, with q's type (int or float)."""
    quantized = Decimal(float(op(f / q))) * Decimal(str(q))
    return type(q)(quantized)


def uniform(rng: np.random.Generator, low: float, high: float, q: float) -> float:
    """Uniform in [low, high], quantized to q."""
    # [l, h + q) floored to q reaches h with the same odds as every other step.
    return quantize(rng.uniform(low, high + q), q, np.floor)


def log_uniform(rng: np.random.Generator, low: float, high: float, q: float) -> float:
    """Log-uniform in [low, high], quantized to q (ceil from (l - q*, h], q* =
    min(q, l / 2), as pycls does)."""
    f = np.exp(-rng.uniform(-np.log(high), -np.log(low - min(q, low / 2))))
    return quantize(f, q, np.ceil)


def power2_uniform(
    rng: np.random.Generator, low: float, high: float, q: float
) -> float:
    """A power of 2 in [low, high], each power equally likely, quantized to q."""
    f2 = np.floor(rng.uniform(np.log2(low), np.log2(high) + 1))
    return quantize(2**f2, q)


def power2_or_log_uniform(
    rng: np.random.Generator, low: float, high: float, q: float
) -> float:
    """Powers of 2 below q, values divisible by q above it; log-linear CDF overall."""
    f = type(q)(power2_uniform(rng, low, high, low))
    return log_uniform(rng, max(low, q), high, min(high, q)) if f >= q else f


def normal(rng: np.random.Generator, low: float, high: float, q: float) -> float:
    """A normal clipped to [low, high] (mean at the centre, ~99.7% inside)."""
    f, mu, sigma = np.inf, (low + high) / 2, (high - low) / 6
    while not low <= f <= high:
        f = rng.normal(mu, sigma)
    return quantize(f, q, np.round)


def log_normal(rng: np.random.Generator, low: float, high: float, q: float) -> float:
    """A log-normal clipped to [low, high] (~99.7% inside)."""
    log_low, log_high = np.log(low), np.log(high)
    f, mu, sigma = np.inf, (log_low + log_high) / 2, (log_high - log_low) / 6
    while not low <= f <= high:
        f = rng.lognormal(mu, sigma)
    return quantize(f, q, np.round)


RAND_TYPES = {
    "uniform": uniform,
    "log_uniform": log_uniform,
    "power2_uniform": power2_uniform,
    "power2_or_log_uniform": power2_or_log_uniform,
    "normal": normal,
    "log_normal": log_normal,
}


def check_rand(key: str, rand_type: str, low: float, high: float, q: float) -> None:
    """Raises ConfigError naming `key` when rand_type(low, high, q) cannot sample."""
    what = f"sampler of {key}: {rand_type}(low={low}, high={high}, q={q})"
    if rand_type not in RAND_TYPES:
        raise ConfigError(f"{what}: RAND_TYPE must be one of {list(RAND_TYPES)}")
    if not (q > 0 and low <= high):
        raise ConfigError(f"{what}: needs QUANTIZE > 0 and low <= high")
    if low <= 0 and rand_type not in ("uniform", "normal"):
        raise ConfigError(f"{what}: needs low > 0")
    on_grid = all(Decimal(str(v)) % Decimal(str(q)) == 0 for v in (low, high))
    if not on_grid and rand_type != "power2_or_log_uniform":
        raise ConfigError(f"{what}: low and high must be multiples of QUANTIZE")
    if "power2" in rand_type and not all(
        float(np.log2(v)).is_integer() for v in (low, high, q)
    ):
        raise ConfigError(f"{what}: low, high and QUANTIZE must be powers of 2")
