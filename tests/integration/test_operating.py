"""Operating a long run, end to end: a training with asynchronous checkpoints, W&B
(offline, the real wandb package), TensorBoard and the CSV is killed (SIGKILL) and
rerun; the W&B run continues, the goodput account charges the redone steps, every
sink carries MFU, gradient norm, memory and goodput, and the run ends bit for bit as
the uninterrupted synchronous one."""

import csv
import os
import re
import signal

import pytest

from pycls_fast.checkpoint import files as ckpt
from pycls_fast.observe.logging import load_json_stats
from tests.helpers import JSON_REL, wait_for_iterations
from tests.integration.test_reliability import (  # noqa: F401 - the fixture
    _assert_same_run,
    _finish,
    _start,
    _train,
    uninterrupted,
)

pytestmark = [pytest.mark.reliability, pytest.mark.slow]
wandb_sink = pytest.importorskip("pycls_fast.observe.wandb_sink")
pytest.importorskip("wandb")

OPTS = [
    "TRAIN.CHECKPOINT_ASYNC", "True", "TRAIN.CHECKPOINT_ITER_PERIOD", "4",
    "LOG_WANDB", "True", "WANDB.MODE", "offline", "LOG_TENSORBOARD", "True",
    "MFU.PEAK_TFLOPS", "0.5",
]  # fmt: skip


def _history(path):
    return [
        r["items"] for r in wandb_sink.read_run_file(path) if r["kind"] == "history"
    ]


def test_kill_and_rerun_keep_one_wandb_run_and_charge_goodput(
    digits,
    tmp_path,
    uninterrupted,  # noqa: F811 - the fixture imported above
    monkeypatch,
):
    monkeypatch.setenv("WANDB_SILENT", "true")
    proc = _start(digits, tmp_path, *OPTS)
    wait_for_iterations(tmp_path, 6)  # the checkpoint of iteration 4 is complete
    os.killpg(proc.pid, signal.SIGKILL)
    _finish(proc)
    logged = [r for r in load_json_stats(tmp_path / "stdout.log")
              if r["_type"] == "train_iter"]  # fmt: skip
    killed_at = int(logged[-1]["iter"].split("/")[0])
    # Iterations take milliseconds: the kill lands at 6 or later (on a busy machine
    # past the next checkpoint), so the resume point is read, not assumed.
    newest = ckpt.last_checkpoint(str(tmp_path))
    saved = re.fullmatch(r".*model_epoch_0001_iter_(\d{6})\.pyth", newest)
    assert saved, newest
    resumed_at = int(saved.group(1))
    assert resumed_at % 4 == 0 and 4 <= resumed_at <= killed_at
    _train(digits, tmp_path, *OPTS)
    # The asynchronous checkpoint resumed from holds the state at its save.
    _assert_same_run(uninterrupted, str(tmp_path))

    records = load_json_stats(tmp_path / "stdout.log")
    epochs = [r for r in records if r["_type"] == "train_epoch"]
    for r in epochs:
        assert r["mfu"] > 0 and r["tflops"] > 0 and r["grad_norm"] > 0
        assert r["host_rss_mb"] > 0 and r["loss_scale"] == 1.0
    # Goodput: two runs; the redone iterations after resumed_at are lost time.
    goodput = [r for r in records if r["_type"] == "goodput"][-1]
    assert goodput["restarts"] == 1
    assert 0 <= goodput["wall_lost_s"] < goodput["wall_step_s"]
    if killed_at > resumed_at:
        assert goodput["wall_lost_s"] > 0
    kinds = ("step", "data", "eval", "checkpoint", "startup", "lost", "other")
    shares = sum(goodput[f"wall_{c}_frac"] for c in kinds)
    # 7 fractions, each logged to 6 significant digits (JSON_REL of at most 1).
    assert shares == pytest.approx(1.0, abs=7 * JSON_REL)

    # W&B: one run id, two starts; the second continues after resumed_at.
    run_files = wandb_sink.run_files(str(tmp_path))
    assert len(run_files) == 2
    run_id = (tmp_path / "wandb_id").read_text().strip()
    for path in run_files:
        assert run_id in os.path.basename(path)
    first, second = (_history(p) for p in run_files)
    first_iters = [h["iteration"] for h in first if "train_iter/mfu" in h]
    second_iters = [h["iteration"] for h in second if "train_iter/mfu" in h]
    # W&B's service (killed with the job) buffers its log file: the killed start
    # keeps a prefix of its records, maybe none.
    assert first_iters == list(range(1, len(first_iters) + 1))
    assert len(first_iters) <= killed_at
    assert second_iters == list(range(resumed_at + 1, 23))
    assert [h["epoch"] for h in second if "goodput/goodput" in h] == [2]

    # The CSV and TensorBoard carry the same fields.
    with open(tmp_path / "epoch_stats.csv") as f:
        rows = [r for r in csv.DictReader(f) if r["_type"] == "train_epoch"]
    assert [float(r["mfu"]) > 0 for r in rows] == [True, True]
    assert all(float(r["wall_lost_s"]) >= 0 and r["goodput"] for r in rows)
    from tensorboard.backend.event_processing.event_accumulator import (
        EventAccumulator,
    )

    events = EventAccumulator(str(tmp_path / "tb_log"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train_iter/mfu", "train_iter/grad_norm", "train_iter/mem_reserved_mb",
            "train_epoch/goodput", "goodput/wall_lost_s"} <= tags  # fmt: skip
