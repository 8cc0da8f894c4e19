"""timm interop: same logits for the same weights, exact round trips, clear errors."""

import pytest
import torch

from pycls_fast.config import ConfigError
from pycls_fast.models import build_model
from pycls_fast.models.timm_compat import build_timm_vit, from_timm, to_timm
from tests.helpers import EXACT, float64_default, tiny_cfg


def _random_timm(cfg):
    model = build_timm_vit(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():  # timm zero-inits some tensors: randomize all
            p.normal_(std=0.2)
    return model


@pytest.mark.parametrize("cls", ["token", "pooled"])
@pytest.mark.parametrize("layout", ["batch_second", "batch_first"])
@pytest.mark.parametrize("layer_scale", ["0", "0.1"])
def test_same_logits_as_timm(cls, layout, layer_scale):
    cfg = tiny_cfg(
        "VIT.CLASSIFIER_TYPE", cls, "VIT.LAYOUT", layout, "VIT.LAYER_SCALE", layer_scale
    )
    # The same model in float64: equal up to summation order (EXACT).
    with float64_default():
        timm_model = _random_timm(cfg)
        ours = build_model(cfg).eval()
        x = torch.randn(3, 3, 32, 32)
    ours.load_state_dict(from_timm(timm_model.state_dict(), cfg))
    with torch.no_grad():
        expected, got = timm_model(x), ours(x)
    assert expected.abs().max() > 0.1  # the comparison is not between zeros
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, expected, **EXACT)


def test_qk_norm_same_logits_as_timm_and_exact_round_trip():
    """VIT.QK_NORM is timm's qk_norm: same logits for the same weights, and the
    q / k norms map both ways; a checkpoint and a config that disagree are refused."""
    cfg = tiny_cfg("VIT.QK_NORM", "True")
    # The same model in float64: equal up to summation order (EXACT).
    with float64_default():
        timm_model = _random_timm(cfg)
        ours = build_model(cfg).eval()
        x = torch.randn(3, 3, 32, 32)
    assert any(".attn.q_norm." in k for k in timm_model.state_dict())
    ours.load_state_dict(from_timm(timm_model.state_dict(), cfg))
    with torch.no_grad():
        expected, got = timm_model(x), ours(x)
    assert expected.abs().max() > 0.1
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, expected, **EXACT)
    back = to_timm(from_timm(timm_model.state_dict(), cfg), cfg)
    assert sorted(back) == sorted(timm_model.state_dict())
    with pytest.raises(ConfigError, match="VIT.QK_NORM"):
        from_timm(timm_model.state_dict(), tiny_cfg())
    # Without the norms the logits differ: the norms are in the forward.
    with float64_default():
        plain = build_model(tiny_cfg()).eval()
    state = {k: v for k, v in ours.state_dict().items() if "_norm." not in k}
    plain.load_state_dict(state)
    with torch.no_grad():
        assert (plain(x) - got).abs().max() > 1e-3


@pytest.mark.parametrize("cls", ["token", "pooled"])
@pytest.mark.parametrize("layer_scale", ["0", "1e-4"])
def test_round_trips_are_exact(cls, layer_scale):
    cfg = tiny_cfg("VIT.CLASSIFIER_TYPE", cls, "VIT.LAYER_SCALE", layer_scale)
    timm_sd = _random_timm(cfg).state_dict()
    back = to_timm(from_timm(timm_sd, cfg), cfg)
    assert sorted(back) == sorted(timm_sd)
    assert all(torch.equal(back[k], timm_sd[k]) for k in timm_sd)
    ours_sd = build_model(cfg).state_dict()
    again = from_timm(to_timm(ours_sd, cfg), cfg)
    assert sorted(again) == sorted(ours_sd)
    assert all(torch.equal(again[k], ours_sd[k]) for k in ours_sd)


def test_pos_embed_resampled_to_another_image_size():
    timm_sd = _random_timm(tiny_cfg()).state_dict()  # 32 px: 4 x 4 patches + token
    cfg = tiny_cfg("TRAIN.IM_SIZE", "48", "TEST.IM_SIZE", "48")  # 6 x 6 patches
    state = from_timm(timm_sd, cfg)
    assert state["pos_embedding"].shape == (1, 37, 48)
    torch.testing.assert_close(state["pos_embedding"][:, 0], timm_sd["pos_embed"][:, 0])
    build_model(cfg).load_state_dict(state)


def test_drop_head_for_fine_tuning():
    timm_sd = _random_timm(tiny_cfg()).state_dict()
    cfg = tiny_cfg("MODEL.NUM_CLASSES", "3")
    with pytest.raises(ConfigError, match="MODEL.NUM_CLASSES"):
        from_timm(timm_sd, cfg)
    state = from_timm(timm_sd, cfg, drop_head=True)
    missing, _ = build_model(cfg).load_state_dict(state, strict=False)
    assert sorted(missing) == ["head.head_fc.bias", "head.head_fc.weight"]


@pytest.mark.parametrize(
    "opts, message",
    [
        (["VIT.CLASSIFIER_TYPE", "pooled"], "VIT.CLASSIFIER_TYPE is 'pooled'"),
        (["VIT.NUM_LAYERS", "3"], "VIT.NUM_LAYERS is 3 but the timm checkpoint has 2"),
        (["VIT.MLP_DIM", "192"], "VIT.MLP_DIM"),
        (
            ["VIT.STEM_TYPE", "conv", "VIT.C_STEM_KERNELS", "[1]", "VIT.C_STEM_STRIDES",
             "[8]", "VIT.C_STEM_DIMS", "[48]"],
            "no conv stem",
        ),
    ],
)  # fmt: skip
def test_mismatches_are_clear_errors(opts, message):
    timm_sd = _random_timm(tiny_cfg()).state_dict()
    with pytest.raises(ConfigError, match=message):
        from_timm(timm_sd, tiny_cfg(*opts))


def test_layer_scale_must_match_the_checkpoint():
    with_ls = _random_timm(tiny_cfg("VIT.LAYER_SCALE", "1e-4")).state_dict()
    assert "blocks.0.ls1.gamma" in with_ls
    with pytest.raises(ConfigError, match="has LayerScale \\(set VIT.LAYER_SCALE"):
        from_timm(with_ls, tiny_cfg())
    with pytest.raises(
        ConfigError, match="VIT.LAYER_SCALE: the timm checkpoint has none"
    ):
        from_timm(
            _random_timm(tiny_cfg()).state_dict(), tiny_cfg("VIT.LAYER_SCALE", "0.1")
        )
