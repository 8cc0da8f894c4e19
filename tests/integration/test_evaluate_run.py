"""Evaluating a finished run: `test_net.py --run OUT_DIR [--best]`, TEST.WEIGHTS
naming a folder, the epoch of the weights, and the eval log beside the run's."""

import json
import os

import pytest

from pycls_fast.observe.logging import load_json_stats
from tests.helpers import DIGITS_CFG, run_tool

SMALL = [
    "TRAIN.IM_SIZE", "16", "TEST.IM_SIZE", "16", "VIT.NUM_LAYERS", "1",
    "VIT.HIDDEN_DIM", "32", "VIT.MLP_DIM", "64", "OPTIM.MAX_EPOCH", "2",
    "TRAIN.CHECKPOINT_KEEP_BEST", "True",
]  # fmt: skip


@pytest.fixture(scope="module")
def run(digits, tmp_path_factory):
    """One finished 2-epoch run for the module's tests (each only reads it, or
    evaluates it into its eval/ folder): (OUT_DIR, its stdout.log's text)."""
    out = str(tmp_path_factory.mktemp("evaluate") / "run")
    result = run_tool(
        "train_net.py", "--cfg", DIGITS_CFG, "DATA.PATH", digits, *SMALL, "OUT_DIR", out
    )
    assert result.returncode == 0, result.stderr
    with open(os.path.join(out, "stdout.log")) as f:
        return out, f.read()


def test_test_net_run_and_best(run):
    out, run_log = run
    newest = os.path.join(out, "checkpoints", "model_epoch_0002.pyth")
    # The config is the run's; MAX_EPOCH overridden to 60 does not relabel the epoch.
    result = run_tool("test_net.py", "--run", out, "OPTIM.MAX_EPOCH", "60")
    assert result.returncode == 0, result.stderr
    assert f"loaded model weights of {newest}: " in result.stdout
    # Which weights of which file, from where in training, in one line (with
    # MAX_EPOCH 60 the run's 2 epochs are not all of them).
    assert (
        f"evaluating model weights of {newest} (epoch 2/60: the run had not "
        "finished)" in result.stdout
    )
    assert "(359 images, epoch 2/60)" in result.stdout
    # The run's own log is untouched; the evaluation's is in OUT_DIR/eval.
    with open(os.path.join(out, "stdout.log")) as f:
        assert f.read() == run_log
    records = load_json_stats(os.path.join(out, "eval", "stdout.log"))
    assert [(r["_type"], r["epoch"]) for r in records] == [("test_epoch", "2/60")]

    with open(os.path.join(out, "checkpoints", "best.json")) as f:
        best = json.load(f)
    result = run_tool("test_net.py", "--run", out, "--best")
    assert result.returncode == 0, result.stderr
    best_file = os.path.join(out, "checkpoints", best["checkpoint"])
    assert f"evaluating model weights of {best_file} (epoch {best['epoch']}/2" in (
        result.stdout
    )
    # No EMA in this run: its EMA weights are refused, in one line, not replaced by
    # the model's.
    result = run_tool("test_net.py", "--run", out, "--best", "TEST.USE_EMA", "True")
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"error: checkpoint {best_file} holds no EMA weights (its run kept none: "
        "OPTIM.EMA_ALPHA 0); take its model weights (TEST.USE_EMA False, export "
        "without --ema, load_trained without ema=True)"
    )


def test_test_weights_folder(run, digits, tmp_path):
    out, _ = run
    newest = os.path.join(out, "checkpoints", "model_epoch_0002.pyth")
    common = ["--cfg", DIGITS_CFG, "DATA.PATH", digits, *SMALL]
    for folder in (out, os.path.join(out, "checkpoints")):
        result = run_tool(
            "test_net.py", *common, "OUT_DIR", str(tmp_path / "eval"),
            "TEST.WEIGHTS", folder,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        assert f"TEST.WEIGHTS {folder}: newest in " in result.stdout
        assert f"loaded model weights of {newest}: " in result.stdout
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("")
    result = run_tool(
        "test_net.py", *common, "OUT_DIR", str(tmp_path / "eval"),
        "TEST.WEIGHTS", str(empty),
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.strip().endswith(
        f"no complete checkpoint in {empty} (nor in its checkpoints/ folder); "
        "it holds: notes.txt"
    )


def test_run_mistakes(tmp_path):
    result = run_tool("test_net.py", "--run", str(tmp_path / "nope"))
    assert result.returncode == 2
    assert f"--run: folder not found {tmp_path / 'nope'}" in result.stderr
    result = run_tool("test_net.py", "--best", "--cfg", DIGITS_CFG)
    assert result.returncode == 2
    assert "--best needs --run OUT_DIR" in result.stderr
    for tool in ("test_net.py", "info_net.py"):
        result = run_tool(tool)
        assert result.returncode == 2
        assert result.stderr.strip() == "error: give --cfg FILE or --run OUT_DIR"


def test_info_net_run(run):
    out, _ = run
    result = run_tool("info_net.py", "--run", out, "--json")
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    assert record["config"] == os.path.join(out, "config.yaml")
    assert record["im_size"] == 16
