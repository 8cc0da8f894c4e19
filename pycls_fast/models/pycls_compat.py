"""Weights of pycls main's ViT, named and shaped as pycls_fast's.

pycls main (since its batch-second commit) wraps `torch.nn.MultiheadAttention` in its
attention block and keeps the position embedding as (sequence, 1, hidden):

    encoder.block_3.self_attention.block.in_proj_weight   (3 * hidden, hidden)
    encoder.block_3.self_attention.block.out_proj.weight  (hidden, hidden)
    pos_embedding                                         (seq, 1, hidden)

pycls_fast's attention holds the same packed [q; k; v] projection as `attn_proj`
(heads split the same way), and its position embedding is (1, sequence, hidden).
pycls's vitconfigs branch already used pycls_fast's names.
"""

import torch

_MAIN_NAMES = {
    "self_attention.block.in_proj_weight": "self_attention.attn_proj.weight",
    "self_attention.block.in_proj_bias": "self_attention.attn_proj.bias",
    "self_attention.block.out_proj.weight": "self_attention.out_proj.weight",
    "self_attention.block.out_proj.bias": "self_attention.out_proj.bias",
}


def is_pycls_main(state_dict: dict[str, torch.Tensor]) -> bool:
    """Whether `state_dict` has pycls main's ViT names (MultiheadAttention inside)."""
    return any(k.endswith(tuple(_MAIN_NAMES)) for k in state_dict)


def from_pycls_main(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """pycls main's ViT state dict with pycls_fast's names and shapes (other keys and
    every tensor's values unchanged)."""
    out = {}
    for key, value in state_dict.items():
        for theirs, ours in _MAIN_NAMES.items():
            if key.endswith(theirs):
                key = key[: -len(theirs)] + ours
                break
        if key == "pos_embedding" and value.dim() == 3 and value.shape[1] == 1:
            value = value.permute(1, 0, 2).contiguous()  # (seq, 1, d) -> (1, seq, d)
        out[key] = value
    return out
