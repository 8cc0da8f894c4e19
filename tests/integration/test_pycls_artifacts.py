"""pycls's own artifacts as a pycls user brings them: a saved config with pycls's
default BN.USE_PRECISE_STATS True trains; the conv stem's BatchNorm statistics are
recomputed, a model without BatchNorm says once that there is nothing to do."""

import os

from tests.helpers import DIGITS_CFG, ROOT, run_tool

PYCLS_SAVED = os.path.join(ROOT, "tests", "data", "pycls_vit_p_4gf.yaml")
SMALL = [
    "TRAIN.IM_SIZE", "16", "TEST.IM_SIZE", "16", "VIT.NUM_LAYERS", "1",
    "VIT.HIDDEN_DIM", "32", "VIT.MLP_DIM", "64", "BN.USE_PRECISE_STATS", "True",
    "BN.NUM_SAMPLES_PRECISE", "128",
]  # fmt: skip


def _log(out):
    with open(os.path.join(out, "stdout.log")) as f:
        return f.read()


def test_pycls_saved_config_with_precise_bn_loads():
    result = run_tool("info_net.py", "--cfg", PYCLS_SAVED, "BN.USE_PRECISE_STATS",
                      "True", "--json")  # fmt: skip
    assert result.returncode == 0, result.stderr


def test_precise_bn_of_the_conv_stem(digits, tmp_path):
    out = str(tmp_path / "conv")
    stem = ["VIT.STEM_TYPE", "conv", "VIT.C_STEM_KERNELS", "[3, 3, 1]",
            "VIT.C_STEM_STRIDES", "[2, 2, 1]",
            "VIT.C_STEM_DIMS", "[8, 16, 32]"]  # fmt: skip
    args = ["--cfg", DIGITS_CFG, "DATA.PATH", digits, *SMALL, *stem]
    result = run_tool("train_net.py", *args, "OPTIM.MAX_EPOCH", "1", "OUT_DIR", out)
    assert result.returncode == 0, result.stderr
    # 128 images / 64 per batch: 2 batches; the stem's 2 BatchNorms (the last conv
    # is the projection).
    assert (
        "BN.USE_PRECISE_STATS: 2 BatchNorm layer(s) recomputed over 2 batch(es) "
        in (_log(out))
    )


def test_precise_bn_without_batch_norm_is_said_once(digits, tmp_path):
    out = str(tmp_path / "patchify")
    result = run_tool("train_net.py", "--cfg", DIGITS_CFG, "DATA.PATH", digits,
                      *SMALL, "OPTIM.MAX_EPOCH", "2", "OUT_DIR", out)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert _log(out).count("BN.USE_PRECISE_STATS: this model has no BatchNorm") == 1
