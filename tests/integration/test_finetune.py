"""Fine-tuning from weights of another class count: the error names
TRAIN.RESET_HEAD, and with it the run starts, saying what it loaded."""

import torch

from pycls_fast.config import load_cfg
from pycls_fast.models import build_model
from tests.helpers import DIGITS_CFG, run_tool

SMALL = [
    "TRAIN.IM_SIZE", "16", "TEST.IM_SIZE", "16", "VIT.NUM_LAYERS", "1",
    "VIT.HIDDEN_DIM", "32", "VIT.MLP_DIM", "64", "OPTIM.MAX_EPOCH", "1",
]  # fmt: skip


def test_reset_head_for_another_class_count(digits, tmp_path):
    torch.manual_seed(0)
    other = build_model(load_cfg(DIGITS_CFG, [*SMALL, "MODEL.NUM_CLASSES", "1000"]))
    weights = str(tmp_path / "imagenet.pyth")
    torch.save(other.state_dict(), weights)  # a plain state dict, as converted
    common = ["--cfg", DIGITS_CFG, "DATA.PATH", digits, *SMALL, "TRAIN.WEIGHTS"]
    result = run_tool("train_net.py", *common, weights, "OUT_DIR", str(tmp_path / "a"))
    assert result.returncode == 2
    assert result.stderr.strip().endswith(
        f"checkpoint {weights} does not fit this model: it has head.head_fc.weight "
        "of shape (1000, 32), the model expects (10, 32) (another class count: "
        "set TRAIN.RESET_HEAD True to re-initialise the classifier)"
    )
    result = run_tool(
        "train_net.py", *common, weights, "TRAIN.RESET_HEAD", "True",
        "OUT_DIR", str(tmp_path / "b"),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    total = len(other.state_dict())
    assert (
        f"TRAIN.WEIGHTS: loaded model weights of {weights}: {total - 2}/{total} "
        "tensors; re-initialised head.head_fc.weight, head.head_fc.bias"
    ) in result.stdout
