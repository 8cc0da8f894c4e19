"""tools/plot_log.py and observe/plots.py: curves, resume marks, run or log path."""

import os
import subprocess
import sys

import pytest

from pycls_fast.errors import UserError
from pycls_fast.observe.logging import dump_json_stats
from pycls_fast.observe.plots import curves, read_run, resume_points
from tests.helpers import JSON_REL, ROOT  # noqa: E402


def _epoch(kind, epoch, loss, top1, top5, **extra):
    return {"_type": kind, "epoch": f"{epoch}/4", "loss": loss, "top1_err": top1,
            "top5_err": top5, **extra}  # fmt: skip


def write_log(folder, resumed_at=(3, 5)):
    """A 4-epoch run with 10 iterations per epoch that resumed at `resumed_at`."""
    os.makedirs(folder, exist_ok=True)
    lines = []
    for e in range(1, 5):
        if (e, 5) == resumed_at:
            lines.append(
                f"[x] resumed from {folder}/checkpoints/model_epoch_0003_iter_000005"
                f".pyth (epoch {resumed_at[0]}, iteration {resumed_at[1]})"
            )
        it = {"_type": "train_iter", "epoch": f"{e}/4", "iter": "10/10", "loss": 1.0}
        train = _epoch("train_epoch", e, 2 / e, 50 / e, 10 / e, lr=0.1, img_per_s=9)
        test = _epoch("test_epoch", e, 2.5 / e, 60 / e, 20 / e)
        lines += [dump_json_stats(r) for r in (it, train, test)]
    log = os.path.join(folder, "stdout.log")
    with open(log, "w") as f:
        f.write("\n".join(f"[x][trainer.py:1] {line}" for line in lines) + "\n")
    return log


def test_curves_include_test_loss_and_top5(tmp_path):
    run = read_run(os.path.dirname(write_log(str(tmp_path / "run"))))
    data = curves(run.records)  # the json_stats figures: 6 significant digits
    assert data["test loss"][0] == [1, 2, 3, 4]
    assert data["test loss"][1] == pytest.approx(
        [2.5, 1.25, 2.5 / 3, 0.625], rel=JSON_REL
    )
    assert data["train top-5 err"][1] == pytest.approx(
        [10, 5, 10 / 3, 2.5], rel=JSON_REL
    )
    assert data["test top-5 err"][1] == pytest.approx([20, 10, 20 / 3, 5], rel=JSON_REL)
    assert "test (EMA) loss" not in data  # no EMA records, no EMA curve
    assert run.name == "run"


def test_resume_marked_where_the_run_resumed(tmp_path):
    log = write_log(str(tmp_path / "run"), resumed_at=(3, 5))
    run = read_run(log)  # a log file names its run too
    assert run.resumes == [2.5]  # epoch 3, iteration 5 of 10
    assert run.name == "run"
    assert resume_points(write_log(str(tmp_path / "b"), resumed_at=None), []) == []


def test_no_log_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="not found"):
        read_run(str(tmp_path))


@pytest.mark.parametrize("which", ["folder", "log"])
def test_plot_log_cli_takes_a_folder_or_its_log(tmp_path, which):
    log = write_log(str(tmp_path / "run"))
    arg = log if which == "log" else os.path.dirname(log)
    result = subprocess.run(
        [sys.executable, "tools/plot_log.py", arg],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    png = tmp_path / "run" / "plots.png"
    assert result.stdout.strip() == f"wrote {png}"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_rerun_epoch_is_drawn_once_from_its_last_record():
    """A run rerun from scratch logs epochs 1-3 twice: one point per epoch, the
    last record's, in epoch order (no zig-zag back to epoch 1)."""
    first = [_epoch("train_epoch", e, 9.0, 90.0, 50.0) for e in (1, 2, 3)]
    again = [_epoch("train_epoch", e, 1.0 / e, 10.0, 5.0) for e in (1, 2)]
    data = curves(first + again)
    assert data["train loss"] == ([1, 2, 3], [1.0, 0.5, 9.0])


def test_resume_marked_when_the_folder_has_a_space(tmp_path):
    log = write_log(str(tmp_path / "my run"), resumed_at=(3, 5))
    assert read_run(log).resumes == [2.5]
