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


def test_weights_of_another_resolution_are_interpolated(digits, tmp_path):
    # Fine-tuning at 24 px from weights trained at 16 px (DeiT's 224 -> 384 step):
    # the position embedding is resampled as timm does, in train_net and test_net.
    from timm.layers import resample_abs_pos_embed

    torch.manual_seed(0)
    for classifier, prefix in (("token", 1), ("pooled", 0)):
        cls = ["VIT.CLASSIFIER_TYPE", classifier]
        low = build_model(load_cfg(DIGITS_CFG, [*SMALL, *cls]))
        weights = str(tmp_path / f"low_{classifier}.pyth")
        torch.save(low.state_dict(), weights)
        high = [*SMALL, *cls, "TRAIN.IM_SIZE", "24", "TEST.IM_SIZE", "24"]
        out = str(tmp_path / f"eval_{classifier}")
        result = run_tool(
            "test_net.py", "--cfg", DIGITS_CFG, "DATA.PATH", digits, *high,
            "TEST.WEIGHTS", weights, "OUT_DIR", out,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        assert "position embedding resampled 4x4 -> 6x6 (bicubic)" in result.stdout
        # The resampled tensor is timm's, and the rest is loaded as it was.
        from pycls_fast.checkpoint.weights import load_model_weights

        model = build_model(load_cfg(DIGITS_CFG, high))
        loaded = load_model_weights(model, weights)
        assert loaded.matched == loaded.total
        want = resample_abs_pos_embed(
            low.pos_embedding.detach(), [6, 6], num_prefix_tokens=prefix
        )
        assert torch.equal(model.pos_embedding.detach(), want)
        assert model.pos_embedding.shape[1] == 36 + prefix
