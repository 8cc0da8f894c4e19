"""tools/avg_checkpoints.py on a run trained here: the last K and the best K
checkpoints (files and a sharded directory mixed), averaged exactly, evaluated by
test_net like any checkpoint."""

import copy
import os

import pytest
import torch

from pycls_fast.checkpoint import sharded
from pycls_fast.config import load_cfg
from pycls_fast.models import build_model
from pycls_fast.observe.logging import load_json_stats
from tests.helpers import DIGITS_CFG, run_tool

pytestmark = pytest.mark.slow  # trains a run, then runs tools as processes

SMALL = ["VIT.NUM_LAYERS", "1", "VIT.HIDDEN_DIM", "32", "VIT.MLP_DIM", "64",
         "TRAIN.IM_SIZE", "16", "TEST.IM_SIZE", "16", "OPTIM.MAX_EPOCH", "4",
         "OPTIM.WARMUP_EPOCHS", "0", "OPTIM.EMA_ALPHA", "0.01",
         "OPTIM.EMA_UPDATE_PERIOD", "1", "TRAIN.CHECKPOINT_PERIOD", "1"]  # fmt: skip


@pytest.fixture(scope="module")
def run_dir(digits, tmp_path_factory):
    out = tmp_path_factory.mktemp("avg") / "run"
    result = run_tool("train_net.py", "--cfg", DIGITS_CFG, *SMALL, "DATA.PATH", digits,
                      "OUT_DIR", str(out))  # fmt: skip
    assert result.returncode == 0, result.stderr
    return out


def _states(paths, key="model_state"):
    return [torch.load(p, weights_only=True)[key] for p in paths]


def _mean(states):
    """The mean in float64, stored in float32: what averaging must give, exactly."""
    return {
        k: (sum(s[k].double() for s in states) / len(states)).float() for k in states[0]
    }


def _assert_equal(a, b):
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _ckpt(out, epoch):
    return str(out / "checkpoints" / f"model_epoch_{epoch:04d}.pyth")


def test_last_k_averaged_and_evaluated(run_dir, digits, tmp_path):
    out = run_dir
    dst = tmp_path / "avg_last3.pyth"
    result = run_tool("avg_checkpoints.py", "--run", str(out), "--last", "3",
                      "--dst", str(dst))  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "model_epoch_0002.pyth, model_epoch_0003.pyth, model_epoch_0004" in (
        result.stdout
    )
    avg = torch.load(dst, weights_only=True)
    paths = [_ckpt(out, e) for e in (2, 3, 4)]
    _assert_equal(avg["model_state"], _mean(_states(paths)))
    _assert_equal(avg["ema_state"], _mean(_states(paths, "ema_state")))
    assert avg["epoch"] == 4 and avg["averaged"][0] == "model_epoch_0002.pyth"
    # The average differs from each of its checkpoints (training moved the weights).
    last = _states(paths[-1:])[0]
    assert not torch.equal(avg["model_state"]["pos_embedding"], last["pos_embedding"])
    # test_net evaluates it like any checkpoint, and keeps its own report.
    test = run_tool("test_net.py", "--run", str(out), "TEST.WEIGHTS", str(dst),
                    "DATA.PATH", digits)  # fmt: skip
    assert test.returncode == 0, test.stderr
    assert "top-1 accuracy:" in test.stdout and "epoch 4/4" in test.stdout
    assert (out / "eval" / "eval_avg_last3.json").is_file()


def test_best_k_from_the_log(run_dir, tmp_path):
    out = run_dir
    errors = {
        int(r["epoch"].split("/")[0]): r["top1_err"]
        for r in load_json_stats(str(out / "stdout.log"))
        if r["_type"] == "test_epoch"
    }
    assert sorted(errors) == [1, 2, 3, 4]
    best = sorted(errors, key=lambda e: (errors[e], -e))[:2]
    result = run_tool("avg_checkpoints.py", "--run", str(out), "--best", "2")
    assert result.returncode == 0, result.stderr
    avg = torch.load(out / "avg_best2.pyth", weights_only=True)
    assert avg["averaged"] == [f"model_epoch_{e:04d}.pyth" for e in sorted(best)]
    _assert_equal(avg["model_state"], _mean(_states([_ckpt(out, e) for e in best])))
    os.remove(out / "avg_best2.pyth")


def test_sharded_and_file_checkpoints_mix(run_dir, tmp_path):
    """Epoch 3 rewritten as a sharded (DCP) checkpoint by the writer FSDP runs use;
    the average of the last 3 is the same, bit for bit."""
    out = run_dir
    folder = tmp_path / "run" / "checkpoints"
    folder.mkdir(parents=True)
    for e in (2, 4):
        os.link(_ckpt(out, e), folder / f"model_epoch_{e:04d}.pyth")
    saved = torch.load(_ckpt(out, 3), weights_only=True)
    cfg = load_cfg(DIGITS_CFG, SMALL)
    model = build_model(cfg)
    model.load_state_dict(saved["model_state"])
    ema = copy.deepcopy(model)
    ema.load_state_dict(saved["ema_state"])
    optimizer = torch.optim.AdamW(model.parameters())
    meta = {"epoch": 3, "iter": 0, "cfg": saved["cfg"]}
    sharded.save(str(folder / "model_epoch_0003.dcp"), model, optimizer, ema, meta, {})
    result = run_tool("avg_checkpoints.py", "--run", str(tmp_path / "run"),
                      "--last", "3")  # fmt: skip
    assert result.returncode == 0, result.stderr
    avg = torch.load(tmp_path / "run" / "avg_last3.pyth", weights_only=True)
    assert avg["averaged"][1] == "model_epoch_0003.dcp"
    paths = [_ckpt(out, e) for e in (2, 3, 4)]
    _assert_equal(avg["model_state"], _mean(_states(paths)))
    _assert_equal(avg["ema_state"], _mean(_states(paths, "ema_state")))


def test_refusals(run_dir, tmp_path):
    cases = [
        (["--run", str(run_dir), "--last", "9"], "fewer than the 9"),
        (["--run", str(run_dir)], "--last K or --best K"),
        (["--checkpoints", str(tmp_path / "nope.pyth"), "--dst", "x.pyth"], "nope"),
        # A folder that does not exist yet, named as one (its trailing slash).
        (
            ["--run", str(run_dir), "--last", "2", "--dst", f"{tmp_path}/new/"],
            "is a directory: name the file to write",
        ),
        (
            [
                "--checkpoints",
                str(tmp_path / "nope.pyth"),
                "--last",
                "0",
                "--dst",
                "x.pyth",
            ],
            "--last / --best choose among --run's checkpoints",
        ),
    ]
    for args, text in cases:
        result = run_tool("avg_checkpoints.py", *args)
        assert result.returncode == 2, (args, result.stderr)
        assert text in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1
