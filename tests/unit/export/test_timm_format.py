"""export/timm_format.py and the ONNX tolerance: timm's model from an export folder
computes ours; shapes timm's VisionTransformer cannot take are refused."""

import pytest
import torch

from pycls_fast.errors import ConfigError
from pycls_fast.export.onnx_format import logit_tolerance
from pycls_fast.export.timm_format import (
    data_config,
    export_timm,
    load_timm,
    logit_difference,
    timm_model_args,
)
from pycls_fast.models import build_model
from tests.helpers import tiny_cfg


@pytest.mark.parametrize(
    "opts",
    [
        ["VIT.CLASSIFIER_TYPE", "token"],
        ["VIT.CLASSIFIER_TYPE", "pooled", "VIT.LAYER_SCALE", "0.1"],
        ["VIT.CLASSIFIER_TYPE", "token", "VIT.QK_NORM", "True"],
    ],
)
def test_round_trip_through_timm(tmp_path, monkeypatch, opts):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = tiny_cfg(*opts)
    model = build_model(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():  # not the zero head of a fresh model
            p.normal_(std=0.2)
    export_timm(model, cfg, str(tmp_path))
    theirs = load_timm(str(tmp_path))
    images = torch.randn(2, 3, 32, 32)
    diff, scale = logit_difference(model, theirs, images)
    assert scale > 0.1 and diff <= logit_tolerance(cfg, scale)
    # A shape mistake is not within it (the tolerance can fail).
    other = build_model(cfg).eval()
    assert logit_difference(model, other, images)[0] > logit_tolerance(cfg, scale)


def test_refusals():
    for opts, key in (
        (["LN.EPS", "1e-5"], "LN.EPS"),
        (["VIT.STEM_TYPE", "conv", "VIT.C_STEM_KERNELS", "[3, 1]",
          "VIT.C_STEM_STRIDES", "[2, 1]", "VIT.C_STEM_DIMS", "[24, 48]"], "STEM"),
        (["VIT.DISTILL_TOKEN", "True", "VIT.CLASSIFIER_TYPE", "token"], "DISTILL"),
    ):  # fmt: skip
        with pytest.raises(ConfigError, match=key):
            timm_model_args(tiny_cfg(*opts))


def test_preprocessing_of_the_test_transform():
    config = data_config(tiny_cfg("TEST.IM_SIZE", "40"))
    assert config["input_size"] == (3, 32, 32) and config["crop_pct"] == 32 / 40
