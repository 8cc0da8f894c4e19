"""`make distill-demo`'s two commands, shortened: the digits ViT trained as a teacher,
then the DeiT-S-shaped student of configs/deit/deit_s_digits_distill.yaml learning
from it with a distillation token; and the same student sharded by FSDP."""

import os

import pytest

from pycls_fast.observe.logging import load_json_stats
from tests.helpers import (
    DIGITS_CFG,
    ROOT,
    run_tool,
)

pytestmark = pytest.mark.slow  # a teacher, then students, trained

STUDENT_CFG = os.path.join(ROOT, "configs/deit/deit_s_digits_distill.yaml")
SMALL = ["TRAIN.IM_SIZE", "16", "TEST.IM_SIZE", "16", "DATA_LOADER.NUM_WORKERS", "1"]


def _teacher(digits, tmp_path):
    out = tmp_path / "teacher"
    result = run_tool("train_net.py", "--cfg", DIGITS_CFG, "DATA.PATH", digits,
                      *SMALL, "OPTIM.MAX_EPOCH", "2", "OUT_DIR", str(out))  # fmt: skip
    assert result.returncode == 0, result.stderr
    return str(out / "checkpoints" / "model_epoch_0002.pyth")


def test_student_learns_from_the_teacher(digits, tmp_path):
    weights = _teacher(digits, tmp_path)
    student = [
        "--cfg", STUDENT_CFG, "DATA.PATH", digits, *SMALL, "OPTIM.MAX_EPOCH", "3",
        "OPTIM.WARMUP_EPOCHS", "0",  # shortened: the 3-epoch warm-up would fill it
        "DISTILL.TEACHER_CFG", DIGITS_CFG, "DISTILL.TEACHER_WEIGHTS", weights,
    ]  # fmt: skip
    result = run_tool("train_net.py", *student, "OUT_DIR", str(tmp_path / "s"))
    assert result.returncode == 0, result.stderr
    assert f"DISTILL.TYPE hard: teacher: loaded model weights of {weights}" in (
        result.stdout
    )
    # The student learns: its training loss falls over the epochs. (Better than
    # chance on the held-out digits needs a trained teacher: the 2-epoch teacher
    # here is near chance itself, and the student learns its answers.)
    records = load_json_stats(str(tmp_path / "s" / "stdout.log"))
    train = [r["loss"] for r in records if r["_type"] == "train_epoch"]
    assert len(train) == 3 and train[-1] < train[0], train
    # Under FSDP (2 processes), the teacher sharded as the student is.
    result = run_tool("train_net.py", *student, "NUM_GPUS", "2", "FSDP.ENABLED",
                      "True", "TRAIN.MIXED_PRECISION", "False", "OPTIM.MAX_EPOCH", "1",
                      "OUT_DIR", str(tmp_path / "fsdp"))  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "final top-1 accuracy" in result.stdout


def test_a_missing_teacher_is_one_line(digits, tmp_path):
    result = run_tool("train_net.py", "--cfg", STUDENT_CFG, "DATA.PATH", digits,
                      *SMALL, "DISTILL.TEACHER_WEIGHTS", str(tmp_path / "none.pyth"),
                      "OUT_DIR", str(tmp_path / "s"))  # fmt: skip
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "none.pyth" in lines[0]
