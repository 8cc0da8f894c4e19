"""train_net, test_net, time_net and plot_log as a user runs them: subprocesses,
their output, exit statuses and one-line errors."""

import csv
import json
import os
import re

import pytest

from tests.helpers import DIGITS_CFG, EXACT, ROOT, run_tool

TINY_CFG = os.path.join(ROOT, "configs/examples/vit_tiny_cpu.yaml")


SMALL = [
    "TRAIN.IM_SIZE", "16", "TEST.IM_SIZE", "16", "VIT.NUM_LAYERS", "1",
    "VIT.HIDDEN_DIM", "32", "VIT.MLP_DIM", "64", "OPTIM.MAX_EPOCH", "1",
]  # fmt: skip


def test_train_net_and_test_net(digits, tmp_path):
    out = str(tmp_path / "run")
    common = ["--cfg", DIGITS_CFG, "DATA.PATH", digits, *SMALL]
    result = run_tool("train_net.py", *common, "OUT_DIR", out)
    assert result.returncode == 0, result.stderr
    assert "final top-1 accuracy:" in result.stdout
    result = run_tool("plot_log.py", out)
    assert result.returncode == 0, result.stderr
    with open(os.path.join(out, "plots.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    weights = os.path.join(out, "checkpoints", "model_epoch_0001.pyth")
    result = run_tool(
        "test_net.py", *common, "OUT_DIR", out + "_test", "TEST.WEIGHTS", weights
    )
    assert result.returncode == 0, result.stderr
    assert "(359 images, epoch 1/1)" in result.stdout
    # Weights of another model: one clear line, exit 2.
    result = run_tool(
        "test_net.py", *common, "VIT.HIDDEN_DIM", "48", "OUT_DIR", out + "_bad",
        "TEST.WEIGHTS", weights,
    )  # fmt: skip
    assert result.returncode == 2
    assert (
        "does not fit this model" in result.stderr and "Traceback" not in result.stderr
    )


@pytest.mark.parametrize(
    "opts, message",
    [
        (["DATA.PATH", "/nonexistent/data"], "/nonexistent/data"),
        (["TEST.WEIGHTS", "/nonexistent/w.pyth"], "checkpoint not found"),
        (["OUT_DIR", "/proc/nope"], "OUT_DIR /proc/nope is not writable"),
        # A crop larger than the evaluation's resize: every test image would fail.
        (
            ["TRAIN.IM_SIZE", "24"],
            "error: TEST.IM_SIZE (16) must be at least "
            "TRAIN.IM_SIZE (24) to evaluate: images are resized to TEST.IM_SIZE, then "
            "center-cropped to TRAIN.IM_SIZE",
        ),
        # Checked once before the ranks start: one line, not one per rank.
        (
            ["NUM_GPUS", "2", "DATA.PATH", "/nonexistent/data"],
            "error: DATA.PATH folder not found: /nonexistent/data",
        ),
        (
            ["NUM_GPUS", "2", "TRAIN.WEIGHTS", "/nonexistent/w.pyth"],
            "error: TRAIN.WEIGHTS: checkpoint not found: /nonexistent/w.pyth",
        ),
        (
            ["NUM_GPUS", "2", "TEST.WEIGHTS", "/nonexistent/w.pyth"],
            "error: TEST.WEIGHTS: checkpoint not found: /nonexistent/w.pyth",
        ),
        (
            [
                "DISTILL.TYPE",
                "soft",
                "DISTILL.TEACHER_CFG",
                DIGITS_CFG,
                "DISTILL.TEACHER_WEIGHTS",
                "/nonexistent/t.pyth",
            ],
            "error: DISTILL.TEACHER_WEIGHTS: checkpoint not found: /nonexistent/t.pyth "
            "(a checkpoint file: pycls_fast's, pycls's or timm's)",
        ),
    ],
)
def test_user_mistakes_are_one_line_exit_2(digits, tmp_path, opts, message):
    tool = "test_net.py" if "TEST.WEIGHTS" in opts else "train_net.py"
    args = ["--cfg", DIGITS_CFG, "DATA.PATH", digits, "OUT_DIR", str(tmp_path), *SMALL]
    result = run_tool(tool, *args, *opts)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "rank" not in result.stderr
    if message.startswith("error: "):
        assert result.stderr.splitlines() == [message]


def test_a_mistake_every_rank_makes_is_one_line(digits, tmp_path):
    """Found by the ranks (weights that do not load): the first failing rank's
    line, once; the ranks' own go to the log, not to stderr."""
    bad = tmp_path / "bad.pyth"
    bad.write_text("not a checkpoint")
    out = tmp_path / "out"
    args = ["--cfg", DIGITS_CFG, "DATA.PATH", digits, "OUT_DIR", str(out), *SMALL]
    result = run_tool("train_net.py", *args, "NUM_GPUS", "2", "TRAIN.WEIGHTS", str(bad))
    assert result.returncode == 2, result.stderr
    [line] = result.stderr.splitlines()
    assert re.fullmatch(f"error: rank [01]: cannot read checkpoint {bad}: .*", line)
    assert str(bad) not in result.stdout
    assert f"training stopped: cannot read checkpoint {bad}" in (
        (out / "stdout.log").read_text()
    )


def test_time_net_json(tmp_path):
    result = run_tool(
        "time_net.py", "--cfg", TINY_CFG, "--json", "--loader-batches", "1",
        "TRAIN.BATCH_SIZE", "8", "TEST.BATCH_SIZE", "8",
        "PREC_TIME.NUM_ITER", "2", "PREC_TIME.WARMUP_ITER", "1",
        "OUT_DIR", str(tmp_path),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout.strip().splitlines()[-1])
    for key in ("train_img_per_s", "test_img_per_s", "loader_img_per_s", "mfu"):
        assert record[key] > 0, key
    assert record["epoch_time_s"] == pytest.approx(
        1_281_167 / min(record["train_img_per_s"], record["loader_img_per_s"])
    )
    assert 0 < record["mfu"] < 1


def test_time_net_infer_csv(tmp_path):
    """--infer: a CSV with timm benchmark.py's columns, ours and timm's rows per
    batch size, the ratio of their images/s."""
    out = tmp_path / "infer.csv"
    result = run_tool("time_net.py", "--cfg", TINY_CFG, *SMALL, "AMP.MODE", "fp32",
                      "--infer", "--batch-sizes", "1,4", "--rounds", "1",
                      "--csv", str(out))  # fmt: skip
    assert result.returncode == 0, result.stderr
    with open(out, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["model"], r["infer_batch_size"]) for r in rows] == [
        ("pycls_fast", "1"), ("timm", "1"), ("pycls_fast", "4"), ("timm", "4"),
    ]  # fmt: skip
    ours, timm = rows[2], rows[3]
    ratio = float(ours["infer_samples_per_sec"]) / float(timm["infer_samples_per_sec"])
    assert float(ours["ratio_to_timm"]) == pytest.approx(ratio, rel=EXACT["rtol"])
    assert ours["amp"].startswith("fp32") and ours["compile"] == "off"
    assert "| 4 | pycls_fast |" in result.stdout
    bad = run_tool("time_net.py", "--cfg", TINY_CFG, "--infer", "--batch-sizes", "x")
    assert bad.returncode == 2 and "--batch-sizes" in bad.stderr


def test_plot_log_without_a_log_is_a_clear_error(tmp_path):
    result = run_tool("plot_log.py", str(tmp_path))
    assert result.returncode == 2 and "no log in" in result.stderr


def test_time_net_keeps_to_its_budget_and_shows_progress(tmp_path):
    # PREC_TIME.NUM_ITER asks for far more than 10 seconds hold: the budget decides.
    result = run_tool(
        "time_net.py", "--cfg", TINY_CFG, "--json", "--seconds", "10",
        "--loader-batches", "1", "TRAIN.BATCH_SIZE", "8", "TEST.BATCH_SIZE", "8",
        "PREC_TIME.NUM_ITER", "100000", "OUT_DIR", str(tmp_path),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = [x for x in result.stderr.splitlines() if x.startswith("time_net: ")]
    phases = " ".join(lines)
    # The training phase says its plan, or (on a machine busy enough that its first
    # round, first-call costs and all, takes over half its share) that the round is
    # the figure.
    assert "train (forward" in phases or "train: one round takes" in phases, phases
    for phase in ("evaluation (batch 8)", "loader:", "matmul peak"):
        assert phase in phases, result.stderr
    assert "timed calls of ~" in phases
    assert json.loads(result.stdout.strip().splitlines()[-1])["train_img_per_s"] > 0


def test_time_net_refuses_a_missing_data_path_at_once(tmp_path):
    missing = str(tmp_path / "nowhere")
    result = run_tool("time_net.py", "--cfg", TINY_CFG, "DATA.PATH", missing)
    assert result.returncode == 2
    assert f"DATA.PATH folder not found: {missing}" in result.stderr
