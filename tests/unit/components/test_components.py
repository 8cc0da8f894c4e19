"""Training engine pieces: AMP modes, optimizers (MTA vs loop), schedules, EMA."""

import math

import pytest
import torch

from pycls_fast.components.ema import create_ema, ema_alpha, update_ema
from pycls_fast.components.optimizer import (
    construct_optimizer,
    lr_at,
    param_groups,
    schedule_warnings,
)
from pycls_fast.components.precision import AmpMode, describe_precision, resolve_amp
from pycls_fast.config import get_cfg
from pycls_fast.engine.trainer import build_components, train_step
from pycls_fast.errors import ConfigError
from pycls_fast.models import build_model
from tests.helpers import EXACT, backend_flags_restored, float64_default, tiny_cfg

MODES = [
    ("fp32", "bf16"),
    ("O1", "bf16"),
    ("O2", "bf16"),
    ("O3", "bf16"),
    ("O1", "fp16"),
    ("O2", "fp16"),
]


def _batch(dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    return torch.randn(16, 3, 32, 32, generator=g).to(dtype), torch.arange(16) % 10


@pytest.mark.parametrize("mode, dtype", MODES)
def test_every_amp_mode_learns(mode, dtype):
    cfg = tiny_cfg(
        "AMP.MODE", mode, "AMP.DTYPE", dtype, "OPTIM.OPTIMIZER", "adamw",
        "OPTIM.BASE_LR", "0.003", "OPTIM.MTA", "True", "OPTIM.WEIGHT_DECAY", "0.0",
    )  # fmt: skip
    parts = build_components(cfg, loaders=False)
    half = parts.half_dtype if parts.mode in (AmpMode.O2, AmpMode.O3) else torch.float32
    images, labels = _batch(half)
    losses = [train_step(parts, images, labels)[0].item() for _ in range(12)]
    assert losses[-1] < 0.7 * losses[0], losses
    assert all(math.isfinite(v) for v in losses)


def test_o2_keeps_fp32_master_weights_and_fp32_layer_norm():
    cfg = tiny_cfg("AMP.MODE", "O2", "AMP.DTYPE", "bf16")
    parts = build_components(cfg, loaders=False)
    model = parts.trained
    assert model.head.head_fc.weight.dtype == torch.bfloat16
    assert model.encoder.ln.weight.dtype == torch.float32  # AMP.LAYER_NORM_FP32
    opt_params = [p for g in parts.optimizer.param_groups for p in g["params"]]
    assert all(p.dtype == torch.float32 for p in opt_params)
    images, labels = _batch(torch.bfloat16)
    train_step(parts, images, labels)
    master = parts.master.master_for(model.head.head_fc.weight)
    # The model holds the bf16 rounding of the fp32 master, which moved off it.
    assert torch.equal(model.head.head_fc.weight, master.to(torch.bfloat16))
    assert not torch.equal(master, master.to(torch.bfloat16).float())


def test_o3_is_all_half():
    parts = build_components(tiny_cfg("AMP.MODE", "O3"), loaders=False)
    assert {p.dtype for p in parts.trained.parameters()} == {torch.bfloat16}
    assert parts.master is None


# MTA True: the fused kernel skips on the device flag; False (the default): the
# loop optimizer, which the scaler skips after reading the flag.
@pytest.mark.parametrize("mta", ["True", "False"], ids=["fused", "loop"])
def test_fp16_overflow_step_is_skipped_without_touching_weights(mta):
    cfg = tiny_cfg(
        "AMP.MODE", "O1", "AMP.DTYPE", "fp16", "OPTIM.MTA", mta,
        "OPTIM.OPTIMIZER", "adamw",
    )  # fmt: skip
    parts = build_components(cfg, loaders=False)
    fused = getattr(parts.optimizer, "_step_supports_amp_scaling", False)
    assert fused == (mta == "True")
    images, labels = _batch()
    train_step(parts, images, labels)  # a normal step first: optimizer state exists
    before = {k: v.clone() for k, v in parts.trained.state_dict().items()}
    opt_before = parts.optimizer.state_dict()["state"][0]["exp_avg"].clone()
    parts.scaler.scale_value = 3e38  # the scaled loss overflows to inf
    _, _, skipped = train_step(parts, images, labels)
    assert skipped and parts.scaler.skipped_steps == 1
    assert parts.scaler.scale_value == pytest.approx(1.5e38)
    after = parts.trained.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert torch.equal(parts.optimizer.state_dict()["state"][0]["exp_avg"], opt_before)
    parts.scaler.scale_value = 2.0**10
    _, _, skipped = train_step(parts, images, labels)
    assert not skipped
    assert not torch.equal(
        before["head.head_fc.weight"], parts.trained.head.head_fc.weight
    )


def test_mixed_precision_flag_maps_to_o1():
    assert resolve_amp(tiny_cfg("TRAIN.MIXED_PRECISION", "True"))[0] is AmpMode.O1
    assert resolve_amp(tiny_cfg())[0] is AmpMode.FP32
    cfg = tiny_cfg("TRAIN.MIXED_PRECISION", "True", "AMP.MODE", "O2")
    assert resolve_amp(cfg)[0] is AmpMode.O2
    # An explicit AMP.MODE wins over pycls's alias, 'fp32' too.
    cfg = tiny_cfg("TRAIN.MIXED_PRECISION", "True", "AMP.MODE", "fp32")
    assert resolve_amp(cfg)[0] is AmpMode.FP32
    # An unloaded config (AMP.MODE '') follows the alias the same way.
    raw = get_cfg()
    raw.TRAIN.MIXED_PRECISION = True
    assert resolve_amp(raw)[0] is AmpMode.O1


def test_describe_precision():
    assert describe_precision(AmpMode.FP32, torch.bfloat16) == "fp32"
    o1 = describe_precision(*resolve_amp(tiny_cfg("AMP.MODE", "O1")))
    assert o1 == "O1 (bf16 autocast, fp32 weights)"
    o2 = describe_precision(AmpMode.O2, torch.float16)
    assert o2 == "O2 (fp16 weights, fp32 master weights)"


@pytest.mark.parametrize("name", ["sgd", "adam", "adamw"])
def test_mta_and_loop_optimizers_agree(name):
    """The fused kernel and the loop compute the same update: in float64 they agree
    to summation-order noise (EXACT), on any CPU."""
    results = []
    for mta in ("True", "False"):
        cfg = tiny_cfg(
            "OPTIM.OPTIMIZER", name, "OPTIM.MTA", mta, "OPTIM.BASE_LR", "0.01"
        )
        torch.manual_seed(0)
        with float64_default():
            model = build_model(cfg)
        torch.nn.init.normal_(model.head.head_fc.weight)
        opt = construct_optimizer(param_groups(model, cfg), cfg)
        assert bool(opt.defaults["fused"]) is (mta == "True")
        # The same synthetic grads for both: compares the update math alone (model
        # grads of e.g. attention's key bias are rounding noise that Adam amplifies).
        g = torch.Generator().manual_seed(2)
        for _ in range(3):
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=g, dtype=torch.float64)
            opt.step()
            opt.zero_grad()
        results.append(model.state_dict())
    for k in results[0]:
        assert results[0][k].dtype == torch.float64
        torch.testing.assert_close(results[0][k], results[1][k], **EXACT)


def test_optimizer_names_build_torchs_classes_with_the_configs_values():
    for name, cls in (("sgd", torch.optim.SGD), ("adam", torch.optim.Adam),
                      ("adamw", torch.optim.AdamW)):  # fmt: skip
        cfg = tiny_cfg("OPTIM.OPTIMIZER", name, "OPTIM.BASE_LR", "0.25",
                       "OPTIM.MOMENTUM", "0.8", "OPTIM.BETA1", "0.7")  # fmt: skip
        opt = construct_optimizer(param_groups(build_model(cfg), cfg), cfg)
        assert type(opt) is cls and opt.defaults["lr"] == 0.25
        if name == "sgd":
            assert opt.defaults["momentum"] == 0.8
        else:
            assert opt.defaults["betas"] == (0.7, cfg.OPTIM.BETA2)


def test_fused_or_foreach_is_chosen_at_construction(monkeypatch):
    from pycls_fast.components import optimizer

    cfg = tiny_cfg("OPTIM.OPTIMIZER", "adamw", "OPTIM.MTA", "True")
    groups = param_groups(build_model(cfg), cfg)
    assert construct_optimizer(groups, cfg).defaults["fused"] is True
    # A device torch has no fused kernel for: foreach, decided before any step.
    monkeypatch.setattr(
        optimizer, "_get_fused_kernels_supported_devices", lambda: ["cuda"]
    )
    opt = construct_optimizer(groups, cfg)
    assert not opt.defaults["fused"] and opt.defaults["foreach"] is True
    # Integer parameters have no fused kernel anywhere.
    ints = [{"params": [torch.zeros(2, dtype=torch.int64)]}]
    monkeypatch.undo()
    assert not optimizer.fused_supported(ints)


def test_frozen_parameters_join_no_group_and_stay_as_they_are():
    cfg = tiny_cfg("OPTIM.OPTIMIZER", "adamw", "OPTIM.WEIGHT_DECAY", "0.5")
    model = build_model(cfg)
    frozen = model.pos_embedding
    frozen.requires_grad_(False)
    groups = param_groups(model, cfg)
    ids = [id(p) for g in groups for p in g["params"]]
    assert sorted(ids) == sorted(id(p) for p in model.parameters() if p.requires_grad)
    before = frozen.clone()
    opt = construct_optimizer(groups, cfg)
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    opt.step()  # weight decay would move a frozen parameter that joined a group
    assert torch.equal(frozen, before) and frozen not in opt.state


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_mta_on_fsdp_shards_steps_as_the_loop(name):
    """FSDP2's parameters are DTensors: DTensor has no rule for torch's fused SGD
    kernel (the first step raised NotImplementedError), so SGD takes the foreach
    path there and AdamW keeps its fused kernel; either way a step on the shards
    equals the per-parameter loop on plain tensors."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        opts = ["OPTIM.OPTIMIZER", name, "OPTIM.MOMENTUM", "0.9"]
        results = []
        for mta, shard in (("False", False), ("True", True)):
            cfg = tiny_cfg(*opts, "OPTIM.MTA", mta)
            torch.manual_seed(0)
            with float64_default():  # one update rule, sharded: EXACT in float64
                model = build_model(cfg)
            if shard:
                fully_shard(model)
            opt = construct_optimizer(param_groups(model, cfg), cfg)
            if shard:
                assert bool(opt.defaults.get("fused")) is (name == "adamw")
                assert bool(opt.defaults.get("foreach")) is (name == "sgd")
            g = torch.Generator().manual_seed(2)
            for _ in range(2):
                for p in model.parameters():
                    grad = torch.randn(p.shape, generator=g, dtype=p.dtype)
                    p.grad = grad if not shard else _like(p, grad)
                opt.step()
                opt.zero_grad()
            results.append({k: v.full_tensor() if shard else v
                            for k, v in model.state_dict().items()})  # fmt: skip
    finally:
        dist.destroy_process_group()
    for k in results[0]:
        torch.testing.assert_close(results[0][k], results[1][k], **EXACT)


def _like(param, full):
    """`full` as a DTensor laid out as `param` (a one-rank mesh: the whole tensor)."""
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full, param.device_mesh, param.placements)


@pytest.mark.parametrize("tf32", [True, False])
def test_backend_flags_follow_the_config(tf32):
    from pycls_fast.components.precision import apply_backend_flags, fp32_math

    with backend_flags_restored():
        apply_backend_flags(
            tiny_cfg("AMP.TF32", str(tf32), "CUDNN.BENCHMARK", str(not tf32))
        )
        expected = "tf32" if tf32 else "ieee"
        assert fp32_math() == expected
        assert torch.backends.cudnn.conv.fp32_precision == expected
        assert torch.backends.cudnn.benchmark is (not tf32)


@pytest.mark.parametrize(
    "name, cls_name", [("lamb", "Lamb"), ("lion", "Lion"), ("adan", "Adan"),
                       ("lars", "Lars"), ("nadamw", "NAdamW")],
)  # fmt: skip
def test_timm_optimizers_keep_our_parameter_groups_and_train(name, cls_name):
    """Optimizers from timm's factory get our groups as they are (weight decay per
    group, layer-decay lr scale) and the betas / momentum of OPTIM."""
    cfg = tiny_cfg(
        "OPTIM.OPTIMIZER", name, "OPTIM.BASE_LR", "0.003", "OPTIM.WEIGHT_DECAY", "0.05",
        "OPTIM.BIAS_USE_CUSTOM_WEIGHT_DECAY", "True", "OPTIM.LAYER_DECAY", "0.75",
        "OPTIM.BETA1", "0.85", "OPTIM.MOMENTUM", "0.8",
    )  # fmt: skip
    parts = build_components(cfg, loaders=False)
    opt = parts.optimizer
    assert type(opt).__name__ == cls_name
    want = param_groups(parts.model, cfg)
    assert len(opt.param_groups) == len(want)
    for got, ref in zip(opt.param_groups, want, strict=True):
        assert [id(p) for p in got["params"]] == [id(p) for p in ref["params"]]
        assert got["weight_decay"] == ref["weight_decay"]
        assert got["lr_scale"] == ref["lr_scale"]
        if "betas" in got and len(got["betas"]) == 2:
            assert tuple(got["betas"]) == (0.85, cfg.OPTIM.BETA2)
        if "momentum" in opt.defaults:
            assert got["momentum"] == 0.8
    images, labels = _batch()
    losses = [train_step(parts, images, labels)[0].item() for _ in range(8)]
    assert losses[-1] < losses[0]


def test_unknown_optimizer_is_one_line_with_the_closest_name():
    with pytest.raises(ConfigError, match=r"OPTIM.OPTIMIZER .*'adamw'.*adamv"):
        tiny_cfg("OPTIM.OPTIMIZER", "adamv")


def test_no_decay_tokens_exempts_position_embedding_and_tokens():
    """OPTIM.NO_DECAY_TOKENS: the parameters timm's no_weight_decay() names go to a
    group without weight decay; off (pycls), they stay with the weights."""
    opts = ["OPTIM.WEIGHT_DECAY", "0.05", "VIT.CLASSIFIER_TYPE", "token"]
    cfg = tiny_cfg(*opts, "OPTIM.NO_DECAY_TOKENS", "True")
    model = build_model(cfg)
    groups = {g["name"]: g for g in param_groups(model, cfg)}
    assert groups["token"]["weight_decay"] == 0.0
    token_ids = {id(p) for p in groups["token"]["params"]}
    assert token_ids == {id(model.pos_embedding), id(model.class_token)}
    # timm's names for them (its register tokens have no counterpart here).
    timm_names = set(_timm_vit().no_weight_decay())
    assert timm_names - {"reg_token"} == {"pos_embed", "cls_token", "dist_token"}
    off = {g["name"]: g for g in param_groups(model, tiny_cfg(*opts))}
    assert "token" not in off
    assert id(model.pos_embedding) in {id(p) for p in off["weights"]["params"]}


def _timm_vit():
    from timm.models.vision_transformer import VisionTransformer

    return VisionTransformer(img_size=32, patch_size=8, embed_dim=48, depth=1,
                             num_heads=4, num_classes=10)  # fmt: skip


def test_weight_decay_groups_follow_pycls():
    cfg = tiny_cfg(
        "OPTIM.WEIGHT_DECAY", "0.1",
        "LN.USE_CUSTOM_WEIGHT_DECAY", "True", "LN.CUSTOM_WEIGHT_DECAY", "0.0",
        "OPTIM.BIAS_USE_CUSTOM_WEIGHT_DECAY", "True", "OPTIM.BIAS_CUSTOM_WEIGHT_DECAY",
        "0.01",
    )  # fmt: skip
    model = build_model(cfg)
    groups = {g["name"]: g for g in param_groups(model, cfg)}
    assert groups["ln"]["weight_decay"] == 0.0
    assert groups["bias"]["weight_decay"] == 0.01
    assert groups["weights"]["weight_decay"] == 0.1
    ln_ids = {id(p) for p in groups["ln"]["params"]}
    assert id(model.encoder.ln.weight) in ln_ids and id(model.encoder.ln.bias) in ln_ids
    weight_ids = {id(p) for p in groups["weights"]["params"]}
    assert id(model.pos_embedding) in weight_ids  # as pycls: not a bias
    total = sum(len(g["params"]) for g in groups.values())
    assert total == len(list(model.parameters()))


def test_lr_policies_and_warmup():
    base = ["OPTIM.BASE_LR", "1.0", "OPTIM.MAX_EPOCH", "10", "OPTIM.MIN_LR", "0.1"]
    cos = tiny_cfg(*base, "OPTIM.LR_POLICY", "cos")
    assert lr_at(cos, 0.0) == pytest.approx(1.0)
    assert lr_at(cos, 5.0) == pytest.approx(0.55)
    assert lr_at(cos, 10.0) == pytest.approx(0.1)
    lin = tiny_cfg(*base, "OPTIM.LR_POLICY", "lin")
    assert lr_at(lin, 5.0) == pytest.approx(0.55)
    exp = tiny_cfg(*base, "OPTIM.LR_POLICY", "exp")
    assert lr_at(exp, 5.0) == pytest.approx(0.1**0.5)
    steps = tiny_cfg(*base, "OPTIM.LR_POLICY", "steps", "OPTIM.STEPS", "[0, 3, 6]")
    assert [lr_at(steps, e) for e in (0, 2.9, 3, 6.5)] == pytest.approx(
        [1.0, 1.0, 0.1, 0.01]
    )
    warm = tiny_cfg(*base, "OPTIM.WARMUP_EPOCHS", "2", "OPTIM.WARMUP_FACTOR", "0.1")
    assert lr_at(warm, 0.0) == pytest.approx(0.1)
    assert lr_at(warm, 1.0) == pytest.approx(lr_at(cos, 1.0) * 0.55)
    # Per iteration by default; pycls's per-epoch update with the switch off.
    assert lr_at(cos, 0.5) < lr_at(cos, 0.0)
    per_epoch = tiny_cfg(*base, "OPTIM.LR_PER_ITER", "False")
    assert lr_at(per_epoch, 0.5) == lr_at(per_epoch, 0.0)


def test_a_warmup_as_long_as_the_run_is_warned_with_the_lr_it_reaches():
    # A constant lr (steps from epoch 0) warmed up from 0.2 over 4 epochs:
    # lr = 0.2 + 0.8 * epoch / 4. The peak is taken at 100 points of the run, the
    # last at epoch 2 * 99 / 100 = 1.98: 0.2 + 0.2 * 1.98 = 0.596.
    base = ["OPTIM.LR_POLICY", "steps", "OPTIM.STEPS", "[0]", "OPTIM.BASE_LR", "1.0",
            "OPTIM.WARMUP_FACTOR", "0.2", "OPTIM.WARMUP_EPOCHS", "4"]  # fmt: skip
    (warning,) = schedule_warnings(tiny_cfg(*base, "OPTIM.MAX_EPOCH", "2"))
    assert warning == (
        "OPTIM.WARMUP_EPOCHS (4) >= OPTIM.MAX_EPOCH (2): the run ends before the "
        "warmup does; the lr peaks at 0.596, never reaching OPTIM.BASE_LR 1"
    )
    assert len(schedule_warnings(tiny_cfg(*base, "OPTIM.MAX_EPOCH", "4"))) == 1
    assert schedule_warnings(tiny_cfg(*base, "OPTIM.MAX_EPOCH", "5")) == []


def test_ema_follows_pycls_rule():
    cfg = tiny_cfg(
        "OPTIM.EMA_ALPHA", "1e-5", "TRAIN.BATCH_SIZE", "64", "OPTIM.MAX_EPOCH", "4",
        "OPTIM.EMA_UPDATE_PERIOD", "32", "OPTIM.WARMUP_EPOCHS", "1",
    )  # fmt: skip
    assert ema_alpha(cfg, 0) == 1.0  # warmup: copy
    alpha = ema_alpha(cfg, 1)
    assert alpha == pytest.approx(1e-5 * 64 / 4 * 32)
    # A TRAIN.SIZE_SCHEDULE stage's batch, given: the rule with that batch.
    assert ema_alpha(cfg, 1, 128) == pytest.approx(1e-5 * 128 / 4 * 32)
    model = build_model(cfg)
    ema = create_ema(model)
    old = ema.head.head_fc.bias.clone()
    with torch.no_grad():
        model.head.head_fc.bias.fill_(1.0)
    update_ema(model, ema, alpha)
    expected = old * (1 - alpha) + 1.0 * alpha
    torch.testing.assert_close(ema.head.head_fc.bias, expected)
    assert not any(p.requires_grad for p in ema.parameters())
