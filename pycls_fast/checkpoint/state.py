"""What a checkpoint holds: the process's RNG states and the parts of a run, each a
Stateful (state_dict() / load_state_dict()).

Every value is a tensor or a plain Python value, so checkpoints load with
`weights_only=True`. CUDA: only this process's own device's generator is saved and
restored (a run resumed with fewer visible GPUs must not index devices it lacks).
"""

import logging
import random
from typing import Protocol

import numpy as np
import torch

logger = logging.getLogger(__name__)


class Stateful(Protocol):
    """A part of a run a checkpoint saves and restores."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


def _numpy_state() -> tuple:
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    return (name, [int(k) for k in keys], int(pos), int(has_gauss), float(gauss))


def _set_numpy_state(state) -> None:
    name, keys, pos, has_gauss, gauss = state
    np.random.set_state(
        (name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss)
    )


def rng_state(device: torch.device | None = None) -> dict:
    """The global RNG states of this process (torch, numpy, python, and the CUDA
    generator of `device` alone; None off CUDA)."""
    cuda = None
    if device is not None and device.type == "cuda" and torch.cuda.is_available():
        cuda = torch.cuda.get_rng_state(device)
    return {
        "torch": torch.get_rng_state(),
        "numpy": _numpy_state(),
        "python": random.getstate(),
        "cuda": cuda,
    }


def set_rng_state(state: dict, device: torch.device | None = None) -> None:
    """Restores what rng_state saved. A CUDA state that is missing, saved off CUDA,
    or not one device's state leaves the CUDA generator as seeded, with a log line."""
    torch.set_rng_state(state["torch"])
    _set_numpy_state(state["numpy"])
    random.setstate(state["python"])
    on_cuda = device is not None and device.type == "cuda"
    cuda = state.get("cuda")
    if not on_cuda or not torch.cuda.is_available():
        return
    if not isinstance(cuda, torch.Tensor):
        logger.info(
            "checkpoint has no CUDA RNG state for %s: it starts as seeded", device
        )
        return
    try:
        torch.cuda.set_rng_state(cuda, device)
    except (RuntimeError, ValueError, IndexError) as e:
        logger.info("CUDA RNG state of the checkpoint not restored (%s): seeded", e)


class GlobalRng:
    """The process's global RNG states as a Stateful."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device

    def state_dict(self) -> dict:
        return rng_state(self.device)

    def load_state_dict(self, state: dict) -> None:
        set_rng_state(state, self.device)
