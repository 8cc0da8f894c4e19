"""ViT model: shapes, layout and classifier equivalences, complexity (pycls counts)."""

import glob
import os

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from pycls_fast.config import load_cfg
from pycls_fast.models import build_model, complexity, vit
from tests.helpers import (
    EXACT,
    ROOT,
    float64_default,
    sampling_band,
    tiny_cfg,
    vit_param_count,
)

CONV_STEM = [
    "VIT.STEM_TYPE", "conv",
    "VIT.C_STEM_KERNELS", "[3, 3, 1]",
    "VIT.C_STEM_STRIDES", "[2, 4, 1]",
    "VIT.C_STEM_DIMS", "[8, 16, 48]",
]  # fmt: skip


@pytest.mark.parametrize("cls", ["token", "pooled"])
@pytest.mark.parametrize("stem", ["patchify", "conv"])
def test_forward_shape_and_dtype(cls, stem):
    extra = CONV_STEM if stem == "conv" else []
    model = build_model(tiny_cfg("VIT.CLASSIFIER_TYPE", cls, *extra))
    out = model(torch.randn(5, 3, 32, 32))
    assert out.shape == (5, 10) and out.dtype == torch.float32


@pytest.mark.parametrize("cls", ["token", "pooled"])
@pytest.mark.parametrize("stem", ["patchify", "conv"])
def test_layouts_give_identical_outputs_and_grads(cls, stem):
    """Same math, summed in another order: in float64 equal up to EXACT."""
    extra = CONV_STEM if stem == "conv" else []
    with float64_default():
        first = build_model(
            tiny_cfg("VIT.LAYOUT", "batch_first", "VIT.CLASSIFIER_TYPE", cls, *extra)
        )
        second = build_model(
            tiny_cfg("VIT.LAYOUT", "batch_second", "VIT.CLASSIFIER_TYPE", cls, *extra)
        )
        x = torch.randn(4, 3, 32, 32)
    # A non-zero head, so that gradients reach every parameter.
    torch.nn.init.normal_(first.head.head_fc.weight)
    second.load_state_dict(first.state_dict())
    out_first, out_second = first(x), second(x)
    assert out_first.dtype == torch.float64
    torch.testing.assert_close(out_first, out_second, **EXACT)
    out_first.square().sum().backward()
    out_second.square().sum().backward()
    for (name, a), (_, b) in zip(first.named_parameters(), second.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, **EXACT, msg=name)


def test_pooled_classifier_is_norm_then_mean():
    model = build_model(tiny_cfg("VIT.CLASSIFIER_TYPE", "pooled")).eval()
    torch.nn.init.normal_(model.head.head_fc.weight)
    x = torch.randn(2, 3, 32, 32)
    tokens = model.stem(x).flatten(2).transpose(1, 2) + model.pos_embedding
    for block in list(model.encoder.children())[:-1]:
        tokens = block(tokens.transpose(0, 1)).transpose(0, 1)
    features = model.encoder.ln(tokens).mean(dim=1)
    torch.testing.assert_close(model(x), model.head(features))


def test_drop_path_only_in_training():
    model = build_model(tiny_cfg("VIT.DROP_PATH", "0.5"))
    torch.nn.init.normal_(model.head.head_fc.weight)
    x = torch.randn(8, 3, 32, 32)
    model.eval()
    torch.testing.assert_close(model(x), model(x))
    model.train()
    assert not torch.allclose(model(x), model(x))
    rates = [b.drop_path_prob for b in list(model.encoder.children())[:-1]]
    assert rates == [0.0, 0.5]


def test_vit_b16_matches_pycls_and_timm_counts():
    cfg = load_cfg(os.path.join(ROOT, "configs/pycls/ViT-P-18GF.yaml"))
    cx = complexity(cfg)
    # pycls's counts for ViT-B/16 (ViT_P-18GF), 224 px, token classifier, 1000 classes
    assert cx == {"params": 86_567_656, "flops": 17_580_319_720, "acts": 23_895_544}
    timm_vit = pytest.importorskip("timm").create_model(
        "vit_base_patch16_224", pretrained=False
    )
    assert sum(p.numel() for p in timm_vit.parameters()) == cx["params"]


def _closed_form(d, m, heads, layers, seq, patches, patch, classes):
    """pycls's ViT counts, written out by hand for a patchify stem."""
    hd = d // heads
    flops = patch * patch * 3 * d * patches + d * patches
    acts = d * patches
    for _ in range(layers):
        flops += seq * (3 * d * d + 3 * d) + 2 * heads * seq * seq * hd
        flops += seq * (d * d + d) + seq * (d * m + m) + seq * (m * d + d)
        acts += 3 * d * seq + heads * seq * seq + heads * seq * hd + d * seq
        acts += m * seq + d * seq
    return flops + d * classes + classes, acts + classes


@pytest.mark.parametrize("cls", ["token", "pooled"])
def test_complexity_closed_form(cls):
    cfg = tiny_cfg("VIT.CLASSIFIER_TYPE", cls)
    seq = 16 + (cls == "token")
    flops, acts = _closed_form(48, 96, 4, 2, seq, 16, 8, 10)
    cx = complexity(cfg)
    assert (cx["flops"], cx["acts"]) == (flops, acts)


def test_qk_norm_counts_its_parameters():
    """Two LayerNorms over head_dim per block (4 x head_dim parameters each)."""
    plain, normed = complexity(tiny_cfg()), complexity(tiny_cfg("VIT.QK_NORM", "True"))
    model = build_model(tiny_cfg("VIT.QK_NORM", "True"))
    n = sum(p.numel() for p in model.parameters())
    head_d, layers = 48 // 4, 2
    assert normed["params"] - plain["params"] == layers * 4 * head_d
    assert normed["params"] == n
    assert normed["flops"] == plain["flops"]  # pycls counts no flops for norms


def test_attention_fp32_runs_the_attention_in_float32(monkeypatch):
    """VIT.ATTENTION_FP32 under bf16 autocast: the attention kernel sees float32
    inputs (so its logits are float32); the block's output stays bf16."""
    seen = []
    cfg = tiny_cfg("VIT.ATTENTION_FP32", "True", "VIT.ATTENTION", "explicit")
    model = build_model(cfg).eval()
    attn = model.encoder.block_0.self_attention
    attn.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    real = vit.attend

    def spy(q, k, v, kernel):
        seen.append(q.dtype)
        return real(q, k, v, kernel)

    monkeypatch.setattr(vit, "attend", spy)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        model(torch.randn(2, 3, 32, 32))
    assert seen[:2] == [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("stem", ["patchify", "conv"])
@pytest.mark.parametrize("cls", ["token", "pooled"])
def test_flops_match_torch_flop_counter(stem, cls):
    # torch counts 2 flops per multiply-add and no bias adds; pycls counts bias adds.
    extra = CONV_STEM if stem == "conv" else []
    cfg = tiny_cfg("VIT.CLASSIFIER_TYPE", cls, "VIT.ATTENTION", "explicit", *extra)
    model = build_model(cfg).eval()
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(torch.randn(1, 3, 32, 32))
    seq = model.params.seq_len
    bias_adds = sum(
        m.out_features * (1 if "head" in name else seq)
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear)
    )
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Conv2d) and m.bias is not None:
            bias_adds += m.out_channels * (
                16 if "last" in name or "patchify" in name else 0
            )
    assert complexity(cfg)["flops"] == counter.get_total_flops() // 2 + bias_adds


@pytest.mark.parametrize(
    "path",
    sorted(
        p
        for p in glob.glob(os.path.join(ROOT, "configs/*/*.yaml"))
        if "/sweeps/" not in p  # sweep configs have their own schema
    ),
    ids=os.path.basename,
)
def test_param_count_equals_module_for_every_config(path):
    cfg = load_cfg(path)
    with torch.device("meta"):
        model = build_model(cfg)
    assert sum(p.numel() for p in model.parameters()) == complexity(cfg)["params"]


def test_attention_kernels_agree():
    from pycls_fast.models.attention import KERNELS, attend

    # The same attention in other kernels: in float64 equal up to EXACT.
    q, k, v = torch.randn(3, 2, 4, 17, 8, dtype=torch.float64).unbind(0)
    ref = attend(q, k, v, "explicit")
    for kernel in ["sdpa", "sdpa_math", "sdpa_flash", "auto"]:
        assert kernel == "auto" or kernel in KERNELS
        torch.testing.assert_close(attend(q, k, v, kernel), ref, **EXACT)


def test_conv_stem_init_matches_pycls_main():
    """pycls main's init: He-normal 3x3 stem convs (std sqrt(2 / w_out)), the last
    stem conv std sqrt(1 / w_out), biases zero; qkv Xavier-uniform."""
    wide = [
        "VIT.STEM_TYPE", "conv",
        "VIT.C_STEM_KERNELS", "[3, 3, 1]",
        "VIT.C_STEM_STRIDES", "[2, 4, 1]",
        "VIT.C_STEM_DIMS", "[64, 128, 48]",
    ]  # fmt: skip
    stem = build_model(tiny_cfg(*wide)).stem
    first, second = stem.cstem0_conv.weight, stem.cstem1_conv.weight
    last = stem.cstem_last_conv
    # A standard deviation estimated from n normal draws errs by 1/sqrt(2n) relative.
    for w, width in ((first, 64), (second, 128), (last.weight, 48)):
        gain = 1.0 if w is last.weight else 2.0
        band = sampling_band(w.numel(), 2**-0.5)
        assert w.std().item() == pytest.approx((gain / width) ** 0.5, rel=band)
    assert torch.count_nonzero(last.bias) == 0


def test_layer_scale_scales_each_branch_and_is_counted():
    cfg = tiny_cfg("VIT.LAYER_SCALE", "1e-4")
    model = build_model(cfg)
    block = model.encoder.block_0
    assert torch.equal(block.ls_1.gamma, torch.full((48,), 1e-4))
    # Counted: 2 x width per block (parameters; pycls counts no elementwise flops).
    plain = complexity(tiny_cfg())
    cx = complexity(cfg)
    assert cx["params"] - plain["params"] == 2 * 2 * 48
    assert (cx["flops"], cx["acts"]) == (plain["flops"], plain["acts"])
    assert sum(p.numel() for p in model.parameters()) == cx["params"]
    # Each residual branch is scaled: with gamma 0 a block is the identity.
    with torch.no_grad():
        block.ls_1.gamma.zero_()
        block.ls_2.gamma.zero_()
    x = torch.randn(17, 2, 48)
    assert torch.equal(block.eval()(x), x)


@pytest.mark.parametrize(
    "name, paper, printed",
    [("g", 1011e6, 1e6), ("G", 1843e6, 1e6),
     # ViT-22B's 21.7B counts no q/k/v or LayerNorm biases (Dehghani et al., 2) and
     # adds q/k LayerNorms: these dimensions with this model's biases give 21.75B.
     ("22B", None, None),
     # PaLI gives ViT-e as "3.9B"; its published dimensions give 3.81B.
     ("e", None, None)],
)  # fmt: skip
def test_large_configs_have_the_papers_parameter_counts(name, paper, printed):
    cfg = load_cfg(os.path.join(ROOT, "configs", "vit", f"ViT-{name}-14.yaml"), [])
    # Exactly the architecture's count from the published dimensions ...
    assert complexity(cfg)["params"] == vit_param_count(cfg)
    if paper is not None:  # ... and the paper's figure, to the digit it prints
        head = cfg.VIT.HIDDEN_DIM * 1000 + 1000  # the papers count the backbone
        assert abs(vit_param_count(cfg) - head - paper) <= printed / 2


def _pycls_module_init(model):
    """pycls's module-by-module ViT init (as this project had it before the init was
    drawn per tensor name), applied in place: the reference for `init_tensor`."""
    torch.manual_seed(0)
    for name, m in model.named_modules():
        if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d, torch.nn.LayerNorm)):
            m.reset_parameters()  # torch's defaults: what pycls leaves untouched
        if isinstance(m, torch.nn.Conv2d) and "patchify" in name:
            fan_in = m.in_channels * m.kernel_size[0] * m.kernel_size[1]
            torch.nn.init.trunc_normal_(m.weight, std=(1.0 / fan_in) ** 0.5)
            torch.nn.init.zeros_(m.bias)
        elif isinstance(m, torch.nn.Linear):
            if name.endswith("attn_proj"):
                torch.nn.init.xavier_uniform_(m.weight)
                torch.nn.init.zeros_(m.bias)
            elif name.endswith("out_proj"):
                torch.nn.init.zeros_(m.bias)
            elif "mlp_block" in name:
                torch.nn.init.xavier_uniform_(m.weight)
                torch.nn.init.normal_(m.bias, std=1e-6)
            elif name.endswith("head_fc"):
                torch.nn.init.zeros_(m.weight)
                torch.nn.init.zeros_(m.bias)
    torch.nn.init.normal_(model.pos_embedding, std=0.02)
    if model.class_token is not None:
        torch.nn.init.zeros_(model.class_token)


@pytest.mark.parametrize("cls", ["token", "pooled"])
def test_name_seeded_init_has_pycls_module_init_statistics(cls):
    """Every tensor of the demo's patchify ViT (configs/examples/vit_digits.yaml) is
    drawn from the distribution of pycls's module-by-module init: the same constants,
    and the same mean and standard deviation up to sampling error."""
    path = os.path.join(ROOT, "configs/examples/vit_digits.yaml")
    cfg = load_cfg(path, ["VIT.CLASSIFIER_TYPE", cls])
    model = build_model(cfg)
    reference = build_model(cfg)
    with torch.no_grad():
        _pycls_module_init(reference)
    drawn = dict(model.named_parameters())
    for name, ref in reference.named_parameters():
        t = drawn[name].detach()
        if ref.numel() == 1 or ref.std() == 0:
            assert torch.equal(t, ref), name
            continue
        # Two independent estimates of a std from n draws (kurtosis <= 3 here, normal
        # or uniform) differ by about std / sqrt(n) (1/sqrt(2n) each); means by
        # std * sqrt(2 / n). Five such standard errors.
        n, std = ref.numel(), ref.std().item()
        assert t.std().item() == pytest.approx(std, rel=sampling_band(n, 1.0)), name
        assert abs(t.mean() - ref.mean()).item() <= sampling_band(n, std * 2**0.5)
