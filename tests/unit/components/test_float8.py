"""AMP.FP8 (components/float8.py): torchao's Float8Linear against the bf16 layer
within the float8 formats' bound, what is converted, the refusals, and a training
step with the EMA, on the CPU with torchao's emulation."""

import pytest
import torch
from torch import nn

from pycls_fast.components.float8 import (
    FP8_EPS,
    compile_warning,
    convert_to_float8,
    float8_linear_config,
    float8_tp_styles,
    fp8_device_refusal,
    is_float8_layer,
)
from pycls_fast.config import get_cfg, load_cfg, with_overrides
from pycls_fast.errors import ConfigError, DeviceError, exit_code
from pycls_fast.models import build_model
from tests.helpers import TINY

FP8 = ["AMP.FP8", "True", "AMP.FP8_EMULATE", "True", "AMP.MODE", "O1"]
# TINY with float8 dims (multiples of 16).
TINY16 = [*TINY, "VIT.HIDDEN_DIM", "32", "VIT.MLP_DIM", "64"]


def _cfg(*opts):
    return load_cfg(None, [*TINY16, *FP8, *opts])


def _worst_case(a, b, ua, ub, amax_a, amax_b, acc_eps):
    """Elementwise bound on |Q(a) @ Q(b) - a @ b| (float64), each operand rounded
    to a format of unit roundoff u (relative error <= u for normal values) after
    dynamic scaling, plus the absolute error of float8's subnormals below the
    scaled amax's 2^-6 / 448 (spacing 2^-9 of the scaled value: at most 2^-10 of
    it, scales rounded down to a power of 2 by at most 2x: amax * 2^-10 / 224), and
    the matmul's own accumulation over K terms in a format of epsilon `acc_eps`
    (K * eps relative to the sum of magnitudes; Higham 3.5)."""
    ea = ua * a.abs() + amax_a * 2.0**-10 / 224
    eb = ub * b.abs() + amax_b * 2.0**-10 / 224
    quant = a.abs() @ eb + ea @ b.abs() + ea @ eb
    k = a.shape[1]
    acc = k * acc_eps * ((a.abs() + ea) @ (b.abs() + eb))
    return quant + acc


def _bf16_error(a, b):
    """Bound on the bf16 layer's own error: inputs rounded to bf16 (u = 2^-8 each),
    fp32 accumulation, the output rounded to bf16."""
    u = torch.finfo(torch.bfloat16).eps / 2
    exact = a.abs() @ b.abs()
    k = a.shape[1]
    return (
        (2 * u + u * u) * exact
        + k * torch.finfo(torch.float32).eps * exact
        + u * ((a @ b).abs() + (2 * u + u * u) * exact)
    )


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_linear_within_the_float8_bound_of_the_bf16_layer(recipe):
    """Forward, input gradient and weight gradient of an emulated Float8Linear
    against the bf16 nn.Linear on the same values: within the float8 operands'
    worst-case bound (e4m3 inputs and weights; tensorwise's e5m2 output gradients)
    plus the bf16 layer's own; and their mean error is that of float8, not bf16's."""
    from torchao.float8.float8_linear import Float8Linear

    cfg = _cfg("AMP.FP8_RECIPE", recipe)
    g = torch.Generator().manual_seed(0)
    m, k, n = 64, 96, 48
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g) / k**0.5
    grad_out = torch.randn(m, n, generator=g)
    ref = nn.Linear(k, n, bias=False)
    with torch.no_grad():
        ref.weight.copy_(w)
    fp8 = Float8Linear.from_float(
        nn.Linear(k, n, bias=False), config=float8_linear_config(cfg, fsdp=False)
    )
    with torch.no_grad():
        fp8.weight.copy_(w)
    # The recipe's formats: e5m2 gradients and one scale per tensor (tensorwise),
    # e4m3 throughout with a scale per row (rowwise).
    grad_dtype = torch.float8_e5m2 if recipe == "tensorwise" else torch.float8_e4m3fn
    assert fp8.config.cast_config_grad_output.target_dtype == grad_dtype
    granularity = fp8.config.cast_config_input.scaling_granularity.value
    assert granularity == ("tensorwise" if recipe == "tensorwise" else "axiswise")
    outs = {}
    for name, layer in (("fp8", fp8), ("bf16", ref)):
        xi = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer(xi)
        y.backward(grad_out.to(y.dtype))
        outs[name] = (y.double(), xi.grad.double(), layer.weight.grad.double())
    u4 = FP8_EPS["e4m3"] / 2
    ug = (FP8_EPS["e5m2"] if recipe == "tensorwise" else FP8_EPS["e4m3"]) / 2
    # The emulated matmuls run in fp32, then under CPU autocast in bf16 (their
    # outputs rounded to bf16: one more u, included in the bf16 term).
    acc = torch.finfo(torch.bfloat16).eps
    xd, wd, gd = x.double(), w.double(), grad_out.double()
    ax, aw, ag = xd.abs().max(), wd.abs().max(), gd.abs().max()
    cases = {
        "output": (xd, wd.t(), u4, u4, ax, aw),
        "grad_input": (gd, wd, ug, u4, ag, aw),
        "grad_weight": (gd.t(), xd, ug, u4, ag, ax),
    }
    for i, (what, (a, b, ua, ub, amax_a, amax_b)) in enumerate(cases.items()):
        bound = _worst_case(a, b, ua, ub, amax_a, amax_b, acc) + _bf16_error(a, b)
        diff = (outs["fp8"][i] - outs["bf16"][i]).abs()
        assert (diff <= bound).all(), (what, float((diff - bound).max()))
        # Not bf16 computed twice: the float8 rounding shows, at least a tenth of
        # e4m3's unit roundoff relative to the output's scale.
        scale = (a @ b).abs().mean()
        assert diff.mean() > 0.1 * u4 * scale / k**0.5, what


def test_the_encoder_linears_become_float8_the_rest_stays():
    cfg = _cfg()
    with torch.device("meta"):
        model = build_model(cfg)
    names = [n for n, _ in model.state_dict().items()]
    converted = convert_to_float8(model, cfg)
    from torchao.float8.float8_linear import Float8Linear

    assert converted == [
        f"encoder.block_{i}.{layer}"
        for i in range(2)
        for layer in (
            "self_attention.attn_proj",
            "self_attention.out_proj",
            "mlp_block.linear_1",
            "mlp_block.linear_2",
        )
    ]
    float8 = {n for n, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert float8 == set(converted)
    assert type(model.head.head_fc) is nn.Linear  # the head stays
    assert isinstance(model.stem.patchify, nn.Conv2d)
    # Checkpoints and exports see the same tensors under the same names.
    assert list(model.state_dict()) == names
    assert not is_float8_layer("head.head_fc") and is_float8_layer(converted[0])
    assert convert_to_float8(model, with_overrides(cfg, {"AMP.FP8": False})) == []


@pytest.mark.parametrize(
    "opts, message",
    [
        (["AMP.DTYPE", "fp16"], "AMP.FP8 True needs AMP.DTYPE bf16"),
        (["VIT.HIDDEN_DIM", "40"], "VIT.HIDDEN_DIM (40) to be a multiple of 16"),
        (
            ["NUM_GPUS", "2", "PARALLEL.TP", "2", "VIT.MLP_DIM", "48"],
            "VIT.MLP_DIM (48) / PARALLEL.TP (2) = 24",
        ),
    ],
    ids=["fp16", "dims", "dims-per-tp-rank"],
)
def test_config_refusals_are_one_line(opts, message):
    with pytest.raises(ConfigError) as e:
        load_cfg(None, [*TINY16, *FP8, *opts])
    assert message in str(e.value) and "\n" not in str(e.value)
    assert exit_code(e.value) == 2


def test_devices_without_float8_matmuls_are_refused_unless_emulated():
    line = fp8_device_refusal(torch.device("cpu"), emulate=False)
    assert "AMP.FP8 True needs a GPU with float8 matmuls" in line
    assert "cpu device" in line and "AMP.FP8_EMULATE True" in line
    assert fp8_device_refusal(torch.device("cpu"), emulate=True) is None
    from pycls_fast.engine.trainer import build_components

    cfg = _cfg("AMP.FP8_EMULATE", "False")
    with pytest.raises(DeviceError) as e:
        build_components(cfg, loaders=False)
    assert exit_code(e.value) == 2 and "\n" not in str(e.value)


def test_compile_warning_and_tp_styles():
    cfg = _cfg("AMP.FP8_EMULATE", "False")
    assert "TRAIN.COMPILE" in compile_warning(cfg)
    assert compile_warning(with_overrides(cfg, {"TRAIN.COMPILE": "block"})) is None
    assert compile_warning(get_cfg()) is None
    # CUDA graphs compile the whole model: the casts are fused there too.
    graphs = with_overrides(cfg, {"TRAIN.CUDA_GRAPHS": True})
    assert compile_warning(graphs) is None
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel

    assert float8_tp_styles(cfg, "cuda")["colwise"] is Float8ColwiseParallel
    # gloo has no float8 types; rowwise scales are not torchao's styles' one scale.
    assert float8_tp_styles(cfg, "cpu") is None
    rowwise = with_overrides(cfg, {"AMP.FP8_RECIPE": "rowwise"})
    assert float8_tp_styles(rowwise, "cuda") is None


def test_a_float8_step_with_an_ema_in_high_precision():
    from torchao.float8.float8_linear import Float8Linear

    from pycls_fast.engine import timing
    from pycls_fast.engine.trainer import build_components, seed_everything, train_step

    cfg = _cfg("OPTIM.EMA_ALPHA", "0.5", "TRAIN.BATCH_SIZE", "4")
    seed_everything(0)
    parts = build_components(cfg, loaders=False)
    assert isinstance(parts.model.encoder.block_0.mlp_block.linear_1, Float8Linear)
    assert not any(isinstance(m, Float8Linear) for m in parts.ema.modules())
    assert parts.after_update is None  # no FSDP: no float8 all-gather to scale
    x, y = timing.synthetic_batch(parts, 4, cfg.TRAIN.IM_SIZE)
    before = parts.model.encoder.block_0.mlp_block.linear_1.weight.detach().clone()
    loss, _, _ = train_step(parts, x, y)
    assert torch.isfinite(loss)
    after = parts.model.encoder.block_0.mlp_block.linear_1.weight
    assert after.dtype == torch.float32 and not torch.equal(after, before)


def _steps(cfg, steps=2):
    from pycls_fast.engine import timing
    from pycls_fast.engine.trainer import build_components, seed_everything, train_step

    seed_everything(0)
    parts = build_components(cfg, loaders=False)
    x, y = timing.synthetic_batch(parts, cfg.TRAIN.BATCH_SIZE, cfg.TRAIN.IM_SIZE)
    losses = [float(train_step(parts, x, y)[0]) for _ in range(steps)]
    return losses, {k: v.float() for k, v in parts.model.state_dict().items()}


@pytest.mark.parametrize("mode", ["O2", "O3"])
def test_float8_trains_under_o2_and_o3(mode):
    losses, _ = _steps(_cfg("AMP.MODE", mode, "TRAIN.BATCH_SIZE", "4"), steps=3)
    assert all(map(torch.isfinite, torch.tensor(losses)))
    assert losses[-1] < losses[0]


def test_activation_checkpointing_recomputes_the_same_float8_casts():
    """A checkpointed block recomputes its forward in backward: the same inputs, so
    the same dynamic scales and float8 values; the steps are those without it."""
    opts = ["TRAIN.BATCH_SIZE", "4", "AMP.MODE", "fp32"]
    plain = _steps(_cfg(*opts))
    checkpointed = _steps(_cfg(*opts, "FSDP.ACTIVATION_CHECKPOINT", "True"))
    assert checkpointed[0] == plain[0]
    for key, value in plain[1].items():
        assert torch.equal(checkpointed[1][key], value), key


def test_a_missing_torchao_is_one_line(monkeypatch):
    import sys

    from pycls_fast.components.float8 import require_torchao

    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # import fails
    with pytest.raises(Exception) as e:
        require_torchao()
    assert exit_code(e.value) == 2 and "pip install 'torchao>=0.18'" in str(e.value)
