"""Goodput: where a run's wall time went, across its restarts.

    account = Goodput(out_dir, process_start)  # rank 0; reads OUT_DIR/goodput.json
    account.resumed_at(position)                # after restoring (global iteration)
    account.started()                           # the first step: start-up ends
    with account.span("eval"): ...              # "eval", "checkpoint", "train"
    account.data_wait(seconds)                  # the loader's waits, as they grow
    account.mark(position)                      # a checkpoint of this position
    account.progress(position); account.save()  # each log line, epoch end, exit
    account.fields()                            # wall_*_s and wall_*_frac fields

The categories, in seconds and as shares of the wall time of all runs so far:
- step: training steps (forward, backward, update, logging): the productive time;
- data: the training loop waiting for a batch;
- eval: evaluation;
- checkpoint: the training loop stalled by checkpoints (the whole write when
  synchronous, the staging to host memory when TRAIN.CHECKPOINT_ASYNC);
- startup: from the process's start (imports included) to the first step;
- lost: steps that a restart does again: the training time from the checkpoint a run
  resumed from to the last position the interrupted run recorded (it moves from
  `step` and `data` to `lost`);
- other: the rest (between epochs, plots, and in an interrupted run the time after
  its last record).
`goodput` is the step share. The account is written to OUT_DIR/goodput.json at every
log line, checkpoint, epoch end and exit, so that a requeued run adds to it; what an
interrupted run did after its last write is not known (up to one log period).
"""

import json
import os
import time
from contextlib import contextmanager

FILE = "goodput.json"
CATEGORIES = ("step", "data", "eval", "checkpoint", "startup", "lost", "other")
# The categories timed directly (lost and other are derived).
MEASURED = ("step", "data", "eval", "checkpoint", "startup")


class Goodput:
    """The wall-time account of one run (kept by the main process)."""

    def __init__(self, out_dir: str, process_start: float | None = None) -> None:
        """`process_start`: the process's start as a time.time() value (default:
        now)."""
        self.path = os.path.join(out_dir, FILE)
        now = time.time()
        start = process_start if process_start is not None else now
        # perf_counter of the process's start: spans use the monotonic clock.
        self.t0 = time.perf_counter() - (now - start)
        saved = _read(self.path)
        self.prior = saved.get("totals", {})  # measured seconds of earlier runs
        self.prior_wall = saved.get("wall", 0.0)
        self.prior_position = saved.get("position", 0)
        self.lost = saved.get("lost", 0.0)
        self.restarts = int(saved.get("runs", 0))
        # Measured training seconds (step + data, all runs) at checkpoint positions.
        self.marks = {int(k): v for k, v in saved.get("marks", {}).items()}
        self.mine = dict.fromkeys(MEASURED, 0.0)  # this run's closed spans
        self.first_step = None
        self.open_train = None  # perf_counter at the start of an open train span
        self.in_train = {"data": 0.0, "checkpoint": 0.0}
        self.position = 0

    def _measured(self, name: str) -> float:
        """Measured seconds of `name` over all runs, an open train span included."""
        value = self.prior.get(name, 0.0) + self.mine[name]
        if self.open_train is not None and name in ("step", "data", "checkpoint"):
            if name == "step":
                elapsed = time.perf_counter() - self.open_train
                value += elapsed - self.in_train["data"] - self.in_train["checkpoint"]
            else:
                value += self.in_train[name]
        return max(value, 0.0)

    def _train_s(self) -> float:
        return self._measured("step") + self._measured("data")

    def resumed_at(self, position: int) -> None:
        """This run starts at global iteration `position` (0: from scratch): the
        training that earlier runs did past it is lost."""
        if self.prior_position > position:
            at = max((p for p in self.marks if p <= position), default=None)
            self.lost += max(self._train_s() - self.marks.get(at, 0.0), 0.0)
        self.marks = {p: s for p, s in self.marks.items() if p < position}
        # From here on, training time counts afresh from this position.
        self.marks[position] = self._train_s()
        self.position = position

    def started(self) -> None:
        """The first training step begins (start-up ends); later calls do nothing."""
        if self.first_step is None:
            self.first_step = time.perf_counter()
            self.mine["startup"] = self.first_step - self.t0

    @contextmanager
    def span(self, name: str):
        """Times the block as `name` ("train", "eval" or "checkpoint"); a checkpoint
        inside a train span is taken out of the step time."""
        start = time.perf_counter()
        if name == "train":
            self.started()
            self.open_train = start
            self.in_train = {"data": 0.0, "checkpoint": 0.0}
        try:
            yield
        finally:
            elapsed = time.perf_counter() - start
            if name == "train":
                inside = self.in_train["data"] + self.in_train["checkpoint"]
                self.mine["step"] += max(elapsed - inside, 0.0)
                self.mine["data"] += self.in_train["data"]
                self.mine["checkpoint"] += self.in_train["checkpoint"]
                self.open_train = None
                self.in_train = {"data": 0.0, "checkpoint": 0.0}
            elif name == "checkpoint" and self.open_train is not None:
                self.in_train["checkpoint"] += elapsed
            else:
                self.mine[name] += elapsed

    def data_wait(self, seconds: float) -> None:
        """The training loop's waits for batches in the open train span so far (the
        loader's running total since the span began)."""
        self.in_train["data"] = seconds

    def mark(self, position: int) -> None:
        """A checkpoint of global iteration `position` was written (or started)."""
        self.marks[position] = self._train_s()
        self.position = max(self.position, position)

    def progress(self, position: int) -> None:
        """Training reached global iteration `position`."""
        self.position = position

    def seconds(self) -> dict[str, float]:
        """Every category's seconds over all runs, and `wall` (their sum)."""
        out = {name: self._measured(name) for name in MEASURED}
        # The lost training was measured as step and data time: it leaves them in
        # proportion.
        train = out["step"] + out["data"]
        lost = min(self.lost, train)
        if train > 0:
            out["step"] -= lost * out["step"] / train
            out["data"] -= lost * out["data"] / train
        out["lost"] = lost
        wall = self.prior_wall + (time.perf_counter() - self.t0)
        out["other"] = max(wall - sum(out.values()), 0.0)
        out["wall"] = wall
        return out

    def fields(self) -> dict[str, float]:
        """The account as flat record fields: wall_s, wall_<category>_s,
        wall_<category>_frac, goodput (the step share) and restarts."""
        secs = self.seconds()
        wall = max(secs["wall"], 1e-9)
        out = {"wall_s": secs["wall"], "goodput": secs["step"] / wall}
        for name in CATEGORIES:
            out[f"wall_{name}_s"] = secs[name]
            out[f"wall_{name}_frac"] = secs[name] / wall
        out["restarts"] = self.restarts
        return out

    def summary(self) -> str:
        """One human line: the goodput and the other shares."""
        return summary_line(self.fields())

    def save(self) -> None:
        """Writes the account to OUT_DIR/goodput.json (atomically): a requeued run
        adds its time to it."""
        state = {
            "totals": {name: self._measured(name) for name in MEASURED},
            "lost": self.lost,
            "wall": self.prior_wall + (time.perf_counter() - self.t0),
            "position": self.position,
            "marks": {str(k): v for k, v in sorted(self.marks.items())},
            "runs": self.restarts + 1,
        }
        tmp = f"{self.path}.tmp.{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(state, f, indent=1)
        os.replace(tmp, self.path)


def _read(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def summary_line(fields: dict) -> str:
    """One human line of an account's `fields()` (or its `goodput` record)."""
    others = ", ".join(
        f"{name} {100 * fields[f'wall_{name}_frac']:.1f}%" for name in CATEGORIES[1:]
    )
    return (
        f"goodput {100 * fields['goodput']:.1f}% of {fields['wall_s']:.0f} s wall "
        f"({int(fields['restarts'])} restart(s)): {others}"
    )
