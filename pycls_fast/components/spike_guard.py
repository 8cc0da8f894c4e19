"""TRAIN.SPIKE_FACTOR: a step whose loss spikes is skipped instead of applied.

A loss that is non-finite, or above SPIKE_FACTOR times the running mean of the
accepted losses (once SPIKE_WARMUP steps were accepted), skips the optimizer step, as
an fp16 overflow does (the trainer passes the flag to the loss scaler's `step`). The
decision is made on the device and agreed by every rank (the largest flag wins);
`record` reads it back to log the skip and stops the run after SPIKE_MAX_SKIPS skips
in a row (LossSpikeError, naming the last good checkpoint). The running mean and the
counters are part of the checkpoint, so a resumed run judges as an uninterrupted one.
"""

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from yacs.config import CfgNode

from pycls_fast.errors import LossSpikeError

# The running mean's decay per accepted step: about the last 50 steps.
MEAN_DECAY = 0.98
KEYS = ("mean", "accepted", "in_a_row", "skipped")

logger = logging.getLogger(__name__)


class SpikeGuard:
    """Judges each step's loss (`check`, on the device) and reports skips (`record`,
    on the host)."""

    def __init__(self, factor: float, warmup: int, max_skips: int) -> None:
        self.factor = factor
        self.warmup = warmup
        self.max_skips = max_skips
        self._state: dict[str, torch.Tensor] | None = None
        self._pending: dict[str, float] | None = None
        self._last: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def _on(self, device: torch.device) -> dict[str, torch.Tensor]:
        if self._state is None or self._state["mean"].device != device:
            values = self._pending or dict.fromkeys(KEYS, 0.0)
            self._state = {
                k: torch.tensor(float(v), dtype=torch.float64, device=device)
                for k, v in values.items()
            }
            self._pending = None
        return self._state

    def check(self, loss: torch.Tensor, judge: bool = True) -> torch.Tensor:
        """The skip flag of the step whose loss is `loss` (0-d): a 0-d float32 device
        tensor, 1.0 to skip. Updates the running mean with an accepted loss.
        `judge` False: this rank only joins the others' decision (a step without
        images, whose loss means nothing); every rank must call it each step."""
        s = self._on(loss.device)
        value = loss.detach().double()
        trusted = s["accepted"] >= max(self.warmup, 1)  # a mean needs a step
        spike = ~torch.isfinite(value) | (trusted & (value > self.factor * s["mean"]))
        flag = (spike & judge).float()
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # one decision for all ranks
        accept = flag == 0
        self._last = (flag, value, s["mean"].clone())
        first = s["accepted"] == 0
        mean = torch.where(
            first, value, MEAN_DECAY * s["mean"] + (1 - MEAN_DECAY) * value
        )
        s["mean"] = torch.where(accept & judge, mean, s["mean"])
        s["accepted"] += accept.double()
        s["in_a_row"] = (s["in_a_row"] + 1) * flag.double()
        s["skipped"] += flag.double()
        return flag

    def record(self, where: str, last_checkpoint: Callable[[], str]) -> bool:
        """Whether the last checked step was skipped (reads the flag: one host sync
        per step while the guard is on). A skip is logged; SPIKE_MAX_SKIPS skips in a
        row raise LossSpikeError. `where`: 'epoch E, iteration I' for the messages."""
        if self._last is None:
            return False
        flag, value, mean = (float(t) for t in self._last)
        self._last = None
        if not flag:
            return False
        in_a_row = int(self._state["in_a_row"])
        logger.warning(
            f"loss spike at {where}: loss {value:.4g} > {self.factor:g} x running "
            f"mean {mean:.4g} (or not finite); step skipped ({in_a_row} in a row)"
        )
        if in_a_row >= self.max_skips:
            raise LossSpikeError(
                f"{in_a_row} steps in a row skipped as loss spikes, the last at "
                f"{where} (loss {value:.4g}, running mean {mean:.4g}); last good "
                f"checkpoint: {last_checkpoint()}; try: lower OPTIM.BASE_LR, "
                "VIT.QK_NORM True, or a larger TRAIN.SPIKE_FACTOR"
            )
        return True

    @property
    def skipped_steps(self) -> int:
        """Steps skipped as spikes so far (a host read)."""
        if self._state is None:
            return int((self._pending or {}).get("skipped", 0))
        return int(self._state["skipped"])

    def state_dict(self) -> dict[str, Any]:
        if self._state is None:
            return dict(self._pending or dict.fromkeys(KEYS, 0.0))
        return {k: float(v) for k, v in self._state.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        device = self._state["mean"].device if self._state is not None else None
        self._pending = {k: float(state[k]) for k in KEYS}
        self._state = None
        if device is not None:
            self._on(device)


def build_spike_guard(cfg: CfgNode) -> SpikeGuard | None:
    """The guard of TRAIN.SPIKE_*, or None when TRAIN.SPIKE_FACTOR is 0 (off)."""
    t = cfg.TRAIN
    if t.SPIKE_FACTOR <= 0:
        return None
    return SpikeGuard(t.SPIKE_FACTOR, t.SPIKE_WARMUP, t.SPIKE_MAX_SKIPS)
