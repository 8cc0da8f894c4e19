"""OPTIM.LAYER_DECAY: the learning-rate scale of every parameter is the one timm's
param_groups_layer_decay gives the equivalent timm ViT (BEiT / DeiT III rule), it
composes with the weight-decay groups, and the schedule applies it every step."""

import pytest
import torch
from timm.optim._param_groups import param_groups_layer_decay

from pycls_fast.components.optimizer import lr_at, param_groups, set_lr
from pycls_fast.engine import timing
from pycls_fast.engine.trainer import build_components, train_step
from pycls_fast.models import build_model
from pycls_fast.models.timm_compat import _key_map, build_timm_vit
from tests.helpers import tiny_cfg


def _scales_by_name(model, groups):
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: g["lr_scale"] for g in groups for p in g["params"]}


@pytest.mark.parametrize("cls", ["token", "pooled"])
def test_lr_scales_are_timms(cls):
    cfg = tiny_cfg("VIT.CLASSIFIER_TYPE", cls, "OPTIM.LAYER_DECAY", "0.65",
                   "VIT.NUM_LAYERS", "3")  # fmt: skip
    ours = build_model(cfg)
    got = _scales_by_name(ours, param_groups(ours, cfg))
    timm_model = build_timm_vit(cfg)
    want = _scales_by_name(
        timm_model, param_groups_layer_decay(timm_model, 0.05, layer_decay=0.65)
    )
    pairs = _key_map(3, cls == "token")
    assert len(pairs) == len(got) == len(want)
    for timm_name, our_name in pairs:
        assert got[our_name] == pytest.approx(want[timm_name]), our_name
    assert min(got.values()) == pytest.approx(0.65**4)  # the stem: d^(L + 1)
    assert got["head.head_fc.weight"] == 1.0
    assert got["encoder.ln.weight"] == got["encoder.block_2.ln_1.weight"] == 0.65


def test_distillation_token_scales_are_timms():
    # timm's VisionTransformerDistilled: the distillation token with the stem, its
    # head with the head.
    from timm.models.deit import VisionTransformerDistilled

    cfg = tiny_cfg("VIT.DISTILL_TOKEN", "True", "DISTILL.TYPE", "hard",
                   "DISTILL.TEACHER_CFG", "t.yaml", "DISTILL.TEACHER_WEIGHTS", "t.pyth",
                   "OPTIM.LAYER_DECAY", "0.65")  # fmt: skip
    ours = build_model(cfg)
    got = _scales_by_name(ours, param_groups(ours, cfg))
    timm_model = VisionTransformerDistilled(
        img_size=32, patch_size=8, embed_dim=48, depth=2, num_heads=2, num_classes=10
    )
    want = _scales_by_name(
        timm_model, param_groups_layer_decay(timm_model, 0.05, layer_decay=0.65)
    )
    pairs = [
        ("dist_token", "dist_token"),
        ("head_dist.weight", "head_dist.head_fc.weight"),
        ("head_dist.bias", "head_dist.head_fc.bias"),
        *_key_map(2, True),
    ]
    assert len(pairs) == len(got) == len(want)
    for timm_name, our_name in pairs:
        assert got[our_name] == pytest.approx(want[timm_name]), our_name


def test_composes_with_the_weight_decay_groups():
    cfg = tiny_cfg("OPTIM.LAYER_DECAY", "0.5", "OPTIM.WEIGHT_DECAY", "0.05",
                   "LN.USE_CUSTOM_WEIGHT_DECAY", "True", "LN.CUSTOM_WEIGHT_DECAY", "0",
                   "OPTIM.BIAS_USE_CUSTOM_WEIGHT_DECAY", "True",
                   "OPTIM.BIAS_CUSTOM_WEIGHT_DECAY", "0")  # fmt: skip
    model = build_model(cfg)
    groups = param_groups(model, cfg)
    names = {id(p): n for n, p in model.named_parameters()}
    for g in groups:
        kind = g["name"].split("_layer")[0]
        for p in g["params"]:
            name = names[id(p)]
            assert g["weight_decay"] == (0.05 if kind == "weights" else 0.0), name
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))
    # Off: the groups are pycls's four, all at scale 1.
    plain = param_groups(model, tiny_cfg())
    assert [g["name"] for g in plain] == ["ln", "bias", "weights"]
    assert all(g["lr_scale"] == 1.0 for g in plain)


@pytest.mark.parametrize("mta", ["True", "False"])
def test_each_step_uses_the_scaled_learning_rate(mta):
    cfg = tiny_cfg("OPTIM.LAYER_DECAY", "0.5", "OPTIM.OPTIMIZER", "sgd",
                   "OPTIM.MOMENTUM", "0", "OPTIM.NESTEROV", "False",
                   "OPTIM.WEIGHT_DECAY", "0", "OPTIM.MTA", mta,
                   "TRAIN.BATCH_SIZE", "8")  # fmt: skip
    parts = build_components(cfg, loaders=False)
    lr = lr_at(cfg, 0.3)
    set_lr(parts.optimizer, lr)
    before = {n: p.detach().clone() for n, p in parts.model.named_parameters()}
    inputs, targets = timing.synthetic_batch(parts, 8, cfg.TRAIN.IM_SIZE)
    # The step's gradients, read before they are cleared: SGD moves by lr x scale x g.
    grads = {}
    hooks = [
        p.register_post_accumulate_grad_hook(
            lambda p, n=n: grads.__setitem__(n, p.grad.detach().clone())
        )
        for n, p in parts.model.named_parameters()
    ]
    train_step(parts, inputs, targets)
    for h in hooks:
        h.remove()
    scales = _scales_by_name(parts.model, parts.optimizer.param_groups)
    # Both sides round the product and the difference once each (fp32, unit
    # roundoff eps / 2): they differ by at most 2 eps of the values involved.
    eps = torch.finfo(torch.float32).eps
    for n, p in parts.model.named_parameters():
        step = lr * scales[n] * grads[n]
        want = before[n] - step
        bound = 2 * eps * (before[n].abs() + step.abs())
        assert ((p.detach() - want).abs() <= bound).all(), n
    assert {round(g["lr"] / lr, 6) for g in parts.optimizer.param_groups} == {
        round(0.5**k, 6) for k in range(4)
    }


def test_weight_decay_is_timms_with_layer_scale():
    # DeiT III's groups (timm): no decay on 1-D parameters, LayerScale gammas included.
    # pycls_fast's: the same with LN / bias decay 0, except the position embedding and
    # class token, which pycls decays.
    cfg = tiny_cfg("VIT.LAYER_SCALE", "1e-4", "OPTIM.LAYER_DECAY", "0.65",
                   "VIT.NUM_LAYERS", "3", "OPTIM.WEIGHT_DECAY", "0.05",
                   "LN.USE_CUSTOM_WEIGHT_DECAY", "True", "LN.CUSTOM_WEIGHT_DECAY", "0",
                   "OPTIM.BIAS_USE_CUSTOM_WEIGHT_DECAY", "True",
                   "OPTIM.BIAS_CUSTOM_WEIGHT_DECAY", "0")  # fmt: skip
    ours = build_model(cfg)
    groups = param_groups(ours, cfg)
    names = {id(p): n for n, p in ours.named_parameters()}
    got = {names[id(p)]: g["weight_decay"] for g in groups for p in g["params"]}
    timm_model = build_timm_vit(cfg)
    timm_names = {id(p): n for n, p in timm_model.named_parameters()}
    want = {
        timm_names[id(p)]: g["weight_decay"]
        for g in param_groups_layer_decay(timm_model, 0.05, layer_decay=0.65)
        for p in g["params"]
    }
    assert got["encoder.block_0.ls_1.gamma"] == 0.0
    for timm_name, our_name in _key_map(3, True, layer_scale=True):
        if timm_name in ("pos_embed", "cls_token"):
            assert got[our_name] == 0.05
        else:
            assert got[our_name] == want[timm_name], our_name
