"""pycls main's ViT checkpoints (torch.nn.MultiheadAttention inside, (seq, 1, hidden)
position embedding) load into pycls_fast's ViT and give pycls's logits."""

import torch
from torch import nn

from pycls_fast.core.checkpoint.weights import load_model_weights
from pycls_fast.models import build_model
from pycls_fast.models.pycls_compat import from_pycls_main, is_pycls_main
from tests.helpers import tiny_cfg

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
        mha = nn.MultiheadAttention(d, heads, batch_first=False)
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
        state = pycls_main_state(cfg)
        assert is_pycls_main(state)
        model = build_model(cfg).eval()
        path = tmp_path / f"pycls_{classifier}.pyth"
        torch.save({"model_state": state, "epoch": 3}, path)  # pycls's layout
        load_model_weights(model, str(path))
        x = torch.randn(2, 3, 32, 32)
        with torch.no_grad():
            ours = model(x)
            theirs = pycls_main_forward(state, cfg, model, x)
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_our_names_pass_through_unchanged():
    state = build_model(tiny_cfg()).state_dict()
    assert not is_pycls_main(state)
    converted = from_pycls_main(state)
    assert converted.keys() == state.keys()
    assert all(converted[k] is state[k] for k in state)
