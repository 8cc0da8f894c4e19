"""A run's record stays true, as a user meets it: reruns into a finished run's
OUT_DIR with another config, a longer schedule, another shape, without resuming;
evaluations beside a run; a run folder as TRAIN.WEIGHTS."""

import os

import pytest
import yaml

from tests.helpers import DIGITS_CFG, run_tool

SMALL = [
    "TRAIN.IM_SIZE", "16", "TEST.IM_SIZE", "16", "VIT.NUM_LAYERS", "1",
    "VIT.HIDDEN_DIM", "32", "VIT.MLP_DIM", "64",
]  # fmt: skip


def _read(path):
    with open(path) as f:
        return f.read()


@pytest.fixture(scope="module")
def trained(digits, tmp_path_factory):
    """A finished one-epoch run of the small digits ViT: (OUT_DIR, its arguments)."""
    out = str(tmp_path_factory.mktemp("record") / "run")
    args = ["--cfg", DIGITS_CFG, "DATA.PATH", digits, *SMALL, "OUT_DIR", out]
    result = run_tool("train_net.py", *args, "OPTIM.MAX_EPOCH", "1")
    assert result.returncode == 0, result.stderr
    # The demo's 5 warmup epochs in a 1-epoch run: said in the start-up log.
    assert "OPTIM.WARMUP_EPOCHS (5) >= OPTIM.MAX_EPOCH (1): the run ends before" in (
        _read(os.path.join(out, "stdout.log"))
    )
    return out, args


def test_changed_key_refused_then_accepted_with_history(trained):
    out, args = trained
    config = os.path.join(out, "config.yaml")
    before = _read(config)
    result = run_tool("train_net.py", *args, "OPTIM.MAX_EPOCH", "1",
                      "OPTIM.BASE_LR", "0.0005")  # fmt: skip
    assert result.returncode == 2, result.stderr
    line = result.stderr.strip()
    assert len(line.splitlines()) == 1, line
    assert "OPTIM.BASE_LR 0.003 -> 0.0005" in line
    assert "TRAIN.ACCEPT_CHANGES OPTIM.BASE_LR" in line
    assert _read(config) == before  # the record still says what was trained

    # A longer schedule: refused, saying what it does to the learning rate.
    result = run_tool("train_net.py", *args, "OPTIM.MAX_EPOCH", "2")
    assert result.returncode == 2
    assert "OPTIM.MAX_EPOCH 1 -> 2 (the cos schedule is recomputed over 2" in (
        result.stderr
    )
    # Accepted explicitly, with a safe change beside it: trains on, both logged, the
    # replaced config kept.
    accept = ["TRAIN.ACCEPT_CHANGES", "OPTIM.MAX_EPOCH", "LOG_PERIOD", "5"]
    result = run_tool("train_net.py", *args, "OPTIM.MAX_EPOCH", "2", *accept)
    assert result.returncode == 0, result.stderr
    assert os.path.isfile(os.path.join(out, "checkpoints", "model_epoch_0002.pyth"))
    kept = yaml.safe_load(_read(os.path.join(out, "config_history", "001.yaml")))
    assert kept["OPTIM"]["MAX_EPOCH"] == 1
    assert yaml.safe_load(_read(config))["OPTIM"]["MAX_EPOCH"] == 2
    log = _read(os.path.join(out, "stdout.log"))
    assert (
        "accepted config change (TRAIN.ACCEPT_CHANGES): OPTIM.MAX_EPOCH 1 -> 2" in log
    )
    assert "leaves the checkpoints' meaning: LOG_PERIOD 10 -> 5" in log

    # Another shape, accepted: the resume names the tensors and the keys.
    wider = ["VIT.HIDDEN_DIM", "48", "TRAIN.ACCEPT_CHANGES", "all"]
    result = run_tool("train_net.py", *args, "OPTIM.MAX_EPOCH", "2", *wider)
    assert result.returncode == 2
    assert (
        "pos_embedding is (1, 16, 32) in the checkpoint, (1, 16, 48) in the model"
        in (result.stderr)
    )
    assert "config keys that differ from the checkpoint's: VIT.HIDDEN_DIM 32 -> 48" in (
        result.stderr
    )
    assert "Traceback" not in result.stderr


def test_training_anew_over_a_run_is_refused(trained):
    out, args = trained
    ckpt = os.path.join(out, "checkpoints", "model_epoch_0001.pyth")
    stats = os.path.join(out, "epoch_stats.csv")
    before = _read(stats)
    stamp = os.stat(ckpt).st_mtime_ns
    result = run_tool("train_net.py", *args, "OPTIM.MAX_EPOCH", "1",
                      "TRAIN.AUTO_RESUME", "False")  # fmt: skip
    assert result.returncode == 2, result.stderr
    line = result.stderr.strip()
    assert len(line.splitlines()) == 1, line
    assert f"OUT_DIR {out} holds a run's checkpoints (newest" in line
    assert "TRAIN.AUTO_RESUME False would train over" in line
    assert os.stat(ckpt).st_mtime_ns == stamp
    assert _read(stats) == before


def test_evaluation_never_writes_into_the_run(trained):
    out, _ = trained
    records = {
        n: _read(os.path.join(out, n)) for n in ("stdout.log", "epoch_stats.csv")
    }
    cfg = os.path.join(out, "config.yaml")
    result = run_tool("test_net.py", "--cfg", cfg, "TEST.WEIGHTS", out)
    assert result.returncode == 0, result.stderr
    assert f"this evaluation logs to {os.path.join(out, 'eval')}" in result.stdout
    for name, text in records.items():
        assert _read(os.path.join(out, name)) == text, name
    assert '"_type": "test_epoch"' in _read(os.path.join(out, "eval", "stdout.log"))
    # No weights named: the run's own are one flag away.
    result = run_tool("test_net.py", "--cfg", cfg)
    assert result.returncode == 2
    assert "--run OUT_DIR" in result.stderr


def test_run_folder_as_train_weights(trained, tmp_path):
    out, args = trained
    args = [a if a != out else str(tmp_path / "ft") for a in args]
    result = run_tool("train_net.py", *args, "OPTIM.MAX_EPOCH", "1",
                      "TRAIN.WEIGHTS", out)  # fmt: skip
    assert result.returncode == 0, result.stderr
    log = _read(str(tmp_path / "ft" / "stdout.log"))
    assert f"TRAIN.WEIGHTS {out}: newest in {os.path.join(out, 'checkpoints')}" in log
    assert "loaded model weights of" in log


def test_time_net_of_a_run_names_its_config(trained):
    out, _ = trained
    quick = ["PREC_TIME.NUM_ITER", "2", "PREC_TIME.WARMUP_ITER", "1"]
    result = run_tool("time_net.py", "--run", out, "--loader-batches", "1", *quick)
    assert result.returncode == 0, result.stderr
    assert f"{os.path.join(out, 'config.yaml')} (--run) on cpu (" in result.stdout
    assert "None" not in result.stdout
