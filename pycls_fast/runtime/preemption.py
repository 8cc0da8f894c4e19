"""Preemption and Ctrl-C: SIGTERM / SIGINT (and SIGUSR2, SLURM's time-limit signal)
become a request to stop at the next iteration boundary, after writing a checkpoint,
instead of dying mid-step.

    stop = StopRequest()
    with stop:                       # handlers installed (main thread only)
        for it in ...:
            ...
            if stop.agreed():        # every rank sees the same answer
                save(...); raise Stopped(...)

A second Ctrl-C while the checkpoint is being written interrupts at once.
"""

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterable
from types import FrameType
from typing import Any

from pycls_fast.errors import Stopped  # noqa: F401 - raised by the trainer
from pycls_fast.runtime import distributed

# SIGUSR2: SLURM's signal before the time limit under submitit (LAUNCH.MODE slurm).
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2)


class StopRequest:
    """Records SIGTERM / SIGINT while installed; `agreed()` tells every rank whether
    any rank has received one, so that all stop at the same iteration."""

    def __init__(self) -> None:
        self.signum = 0
        self._previous = {}

    def _handle(self, signum, frame):
        if self.signum and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        self.signum = self.signum or signum

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> bool:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
        return False

    def agreed(self) -> int:
        """The signal number any rank received (0 for none); a collective when
        several ranks run, so call it at the same point on every rank."""
        if not distributed.is_initialized():
            return self.signum
        return int(distributed.all_reduce_max([float(self.signum)])[0])


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


def stop_message(signum: int, epoch: int, iteration: int, path: str | None) -> str:
    """The line a stopped run ends with."""
    where = f"epoch {epoch + 1}, iteration {iteration}"
    saved = f"wrote checkpoint {path}" if path else "checkpoint written by rank 0"
    return (
        f"stopped by {signal_name(signum)} at {where}: {saved}; rerun the same "
        "command to resume"
    )


def forward_signals(pids: Callable[[], Iterable[int]]) -> dict[int, Any]:
    """Installs SIGTERM / SIGINT handlers in a launcher process that send SIGTERM to
    its children (the ranks), which then checkpoint and stop; returns the previous
    handlers for `restore_signals`. SIGTERM, not the signal received: a Ctrl-C
    reaches the children from the terminal too, and a second SIGINT would make them
    stop without a checkpoint."""

    def forward(signum: int, frame: FrameType | None) -> None:
        for pid in pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)

    return {sig: signal.signal(sig, forward) for sig in SIGNALS}


def restore_signals(previous: dict[int, Any]) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)
