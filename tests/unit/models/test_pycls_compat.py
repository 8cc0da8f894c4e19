"""pycls main's ViT checkpoints (torch.nn.MultiheadAttention inside, (seq, 1, hidden)
position embedding) load into pycls_fast's ViT and give pycls's logits; evaluated with
pycls's channel order and pycls's choice between model and EMA weights."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pycls_fast.checkpoint.weights import (
    checkpoint_channel_order,
    load_model_weights,
)
from pycls_fast.config import load_cfg
from pycls_fast.engine import trainer
from pycls_fast.engine.trainer import build_components
from pycls_fast.models import build_model
from pycls_fast.models.pycls_compat import from_pycls_main, is_pycls_main
from tests.helpers import (
    DIGITS_CFG,
    EXACT,
    float64_default,
    order_tolerance,
    rounding_tolerance,
    tiny_cfg,
    vit_roundings,
)

_OURS_TO_MAIN = {
    "self_attention.attn_proj.weight": "self_attention.block.in_proj_weight",
    "self_attention.attn_proj.bias": "self_attention.block.in_proj_bias",
    "self_attention.out_proj.weight": "self_attention.block.out_proj.weight",
    "self_attention.out_proj.bias": "self_attention.block.out_proj.bias",
}


def pycls_main_state(cfg):
    """A random model's weights named and shaped as pycls main saves them."""
    model = build_model(cfg)
    for p in model.parameters():
        nn.init.normal_(p, std=0.05)
    out = {}
    for key, value in model.state_dict().items():
        for ours, theirs in _OURS_TO_MAIN.items():
            if key.endswith(ours):
                key = key[: -len(ours)] + theirs
        if key == "pos_embedding":
            value = value.permute(1, 0, 2).contiguous()
        out[key] = value.clone()
    return out


def pycls_main_forward(state, cfg, model, x):
    """pycls main's ViT forward, its attention run by torch.nn.MultiheadAttention on
    the pycls-named weights (stem, norms, MLPs and head taken from `model`)."""
    d, heads = cfg.VIT.HIDDEN_DIM, cfg.VIT.NUM_HEADS
    x = model.stem(x).flatten(2).permute(2, 0, 1)  # (seq, n, d)
    if model.class_token is not None:
        x = torch.cat([model.class_token.expand(-1, x.size(1), -1), x], dim=0)
    x = x + state["pos_embedding"]
    for i in range(cfg.VIT.NUM_LAYERS):
        block = getattr(model.encoder, f"block_{i}")
        mha = nn.MultiheadAttention(d, heads, batch_first=False, dtype=x.dtype)
        prefix = f"encoder.block_{i}.self_attention.block."
        mha.load_state_dict(
            {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
        )
        y = block.ln_1(x)
        x = x + mha(y, y, y, need_weights=False)[0]
        x = x + block.mlp_block(block.ln_2(x))
    x = model.encoder.ln(x)
    x = x[0] if model.class_token is not None else x.mean(dim=0)
    return model.head(x)


def test_pycls_main_weights_give_pycls_logits(tmp_path):
    for classifier in ("token", "pooled"):
        cfg = tiny_cfg("VIT.CLASSIFIER_TYPE", classifier)
        # pycls's forward of the same weights, in float64: equal up to EXACT.
        with float64_default():
            state = pycls_main_state(cfg)
            model = build_model(cfg).eval()
            x = torch.randn(2, 3, 32, 32)
        assert is_pycls_main(state)
        path = tmp_path / f"pycls_{classifier}.pyth"
        torch.save({"model_state": state, "epoch": 3}, path)  # pycls's layout
        load_model_weights(model, str(path))
        with torch.no_grad():
            ours = model(x)
            theirs = pycls_main_forward(state, cfg, model, x)
        assert ours.dtype == torch.float64
        torch.testing.assert_close(ours, theirs, **EXACT)


def test_our_names_pass_through_unchanged():
    state = build_model(tiny_cfg()).state_dict()
    assert not is_pycls_main(state)
    converted = from_pycls_main(state)
    assert converted.keys() == state.keys()
    assert all(converted[k] is state[k] for k in state)


# ------------------- pycls's checkpoints: channel order and EMA -------------------- #

# pycls's ImageNet loader (pycls/datasets/imagenet.py): color_norm in RGB with these
# statistics, then HWC/RGB -> CHW/BGR.
PYCLS_MEAN, PYCLS_STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def _digits_cfg(digits, tmp_path, *opts):
    return load_cfg(
        DIGITS_CFG,
        ["DATA.PATH", digits, "OUT_DIR", str(tmp_path / "out"),
         "TRAIN.IM_SIZE", "16", "TEST.IM_SIZE", "16", "VIT.PATCH_SIZE", "4",
         "VIT.NUM_LAYERS", "2", "VIT.HIDDEN_DIM", "32", "VIT.NUM_HEADS", "4",
         "VIT.MLP_DIM", "64", "TEST.BATCH_SIZE", "120", *opts],
    )  # fmt: skip


def _pycls_checkpoint(cfg, path, test_err, ema_err):
    """A checkpoint as pycls main's trainer saves it; returns (model, EMA) states."""
    torch.manual_seed(1)
    model_state, ema_state = pycls_main_state(cfg), pycls_main_state(cfg)
    torch.save(
        {"epoch": 7, "model_state": model_state, "ema_state": ema_state,
         "optimizer_state": {}, "test_err": test_err, "ema_err": ema_err,
         "cfg": cfg.dump()},
        path,
    )  # fmt: skip
    return model_state, ema_state


def _pycls_evaluation(cfg, state):
    """Loss, top-1 error and the largest |logit| of pycls-named `state` on the test
    split, computed with pycls's preprocessing (BGR, per-channel statistics) and
    pycls's forward."""
    parts = build_components(cfg, loaders=("test",))
    model = build_model(cfg).eval()
    model.load_state_dict(from_pycls_main(state))
    mean = torch.tensor(PYCLS_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(PYCLS_STD).view(1, 3, 1, 1)
    losses, wrong, count, largest = 0.0, 0, 0, 0.0
    with torch.no_grad():
        for images, labels in parts.test_loader:
            rgb = (images.float() / 255.0 - mean) / std
            logits = pycls_main_forward(state, cfg, model, rgb.flip(1))  # BGR
            losses += F.cross_entropy(logits, labels, reduction="sum").item()
            wrong += (logits.argmax(1) != labels).sum().item()
            count += len(labels)
            largest = max(largest, logits.abs().max().item())
    return losses / count, 100.0 * wrong / count, largest


@pytest.mark.parametrize(
    "test_err,ema_err,chosen", [(40.0, 30.0, "ema"), (30.0, 30.0, "model")]
)
def test_a_pycls_checkpoint_is_evaluated_as_pycls_would(
    digits, tmp_path, capsys, test_err, ema_err, chosen
):
    path = tmp_path / "model_epoch_0007.pyth"
    cfg = _digits_cfg(digits, tmp_path, "TEST.WEIGHTS", str(path))
    assert cfg.DATA.CHANNEL_ORDER == "auto"
    model_state, ema_state = _pycls_checkpoint(cfg, path, test_err, ema_err)
    record = trainer.test_model(cfg)
    log = capsys.readouterr().out
    assert "DATA.CHANNEL_ORDER auto: bgr (a pycls checkpoint" in log
    which = "EMA weights" if chosen == "ema" else "model weights"
    assert f"loaded {which} of {path}" in log and "pycls's rule" in log
    bgr = load_cfg(DIGITS_CFG, [*_digits_opts(cfg), "DATA.CHANNEL_ORDER", "bgr"])
    state = ema_state if chosen == "ema" else model_state
    loss, top1, largest = _pycls_evaluation(bgr, state)
    # Two fp32 forwards of one function in other orders (the loader's normalization
    # on the device, MultiheadAttention's ops): each logit errs by the roundings
    # counted relative to the largest logit (+ 4 for the normalization's), and
    # cross-entropy's slope in the logits is at most 2 in the L1 norm; the two sum
    # each batch's losses in fp32 in other orders (order_tolerance).
    roundings = vit_roundings(cfg.VIT.NUM_LAYERS) + 4
    atol = 2 * rounding_tolerance(torch.float32, roundings) * largest
    atol += order_tolerance(torch.float32, cfg.TEST.BATCH_SIZE) * loss
    assert record["loss"] == pytest.approx(loss, rel=0, abs=atol)
    assert record["top1_err"] == pytest.approx(top1, rel=EXACT["rtol"])


def _digits_opts(cfg):
    return ["DATA.PATH", cfg.DATA.PATH, "OUT_DIR", cfg.OUT_DIR, "TRAIN.IM_SIZE", "16",
            "TEST.IM_SIZE", "16", "VIT.PATCH_SIZE", "4", "VIT.NUM_LAYERS", "2",
            "VIT.HIDDEN_DIM", "32", "VIT.NUM_HEADS", "4", "VIT.MLP_DIM", "64",
            "TEST.BATCH_SIZE", "120"]  # fmt: skip


def test_an_explicit_channel_order_is_kept(digits, tmp_path):
    path = tmp_path / "pycls.pyth"
    cfg = _digits_cfg(digits, tmp_path, "TEST.WEIGHTS", str(path))
    _pycls_checkpoint(cfg, path, 40.0, 30.0)
    auto = trainer.test_model(cfg)
    rgb = trainer.test_model(_digits_cfg(digits, tmp_path, "TEST.WEIGHTS", str(path),
                                 "DATA.CHANNEL_ORDER", "rgb"))  # fmt: skip
    assert auto["loss"] != rgb["loss"]


def test_channel_order_read_from_checkpoints(tmp_path):
    cfg = tiny_cfg("DATA.CHANNEL_ORDER", "bgr")
    ours = tmp_path / "ours.pyth"
    state = build_model(cfg).state_dict()
    torch.save({"model_state": state, "scaler_state": {}, "cfg": cfg.dump()}, ours)
    assert checkpoint_channel_order(str(ours))[0] == "bgr"
    converted = tmp_path / "converted.pyth"
    torch.save({"model_state": state}, converted)  # e.g. convert_weights.py's
    assert checkpoint_channel_order(str(converted)) is None
    pycls = tmp_path / "pycls.pyth"
    torch.save({"model_state": pycls_main_state(cfg), "epoch": 1}, pycls)
    assert checkpoint_channel_order(str(pycls))[0] == "bgr"
