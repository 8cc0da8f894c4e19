"""Vision Transformer with patchify or conv stem, token or pooled classifier.

References:
    https://arxiv.org/abs/2010.11929 (An Image is Worth 16x16 Words)
    https://arxiv.org/abs/2106.14881 (Early Convolutions Help Transformers See Better)

Parameter names follow pycls, so pycls ViT weights load as they are. Each module keeps
its `complexity` beside its `forward`: change one, change the other.

Layout: with `batch_first=False` (the default, 'batch_second') the encoder works on
(seq, batch, hidden) tensors, otherwise on (batch, seq, hidden). Both give the same
outputs for the same weights; the layout only changes which transposes are made.
"""

import dataclasses
import hashlib
import math
from collections.abc import Sequence

import torch
from torch import nn
from torch.nn import init
from yacs.config import CfgNode

from pycls_fast.models.attention import attend
from pycls_fast.models.blocks import (
    conv2d,
    conv2d_cx,
    drop_path,
    layernorm,
    layernorm_cx,
    linear,
    linear_cx,
    norm2d,
    norm2d_cx,
    patchify2d,
    patchify2d_cx,
)


@dataclasses.dataclass(frozen=True)
class ViTParams:
    """Everything that defines a ViT; `from_cfg` reads it from a config."""

    image_size: int = 224
    patch_size: int = 16
    stem_type: str = "patchify"
    c_stem_kernels: tuple = ()
    c_stem_strides: tuple = ()
    c_stem_dims: tuple = ()
    n_layers: int = 12
    n_heads: int = 12
    hidden_d: int = 768
    mlp_d: int = 3072
    cls_type: str = "token"
    num_classes: int = 1000
    ln_eps: float = 1e-5
    bn_eps: float = 1e-5
    bn_mom: float = 0.1
    relu_inplace: bool = True
    batch_first: bool = False
    attention: str = "auto"
    drop_path: float = 0.0
    layer_scale: float = 0.0
    distill_token: bool = False
    qk_norm: bool = False
    attention_fp32: bool = False

    @staticmethod
    def from_cfg(cfg: CfgNode) -> "ViTParams":
        """Reads the model parameters from a (checked) config."""
        return ViTParams(
            image_size=cfg.TRAIN.IM_SIZE,
            patch_size=cfg.VIT.PATCH_SIZE,
            stem_type=cfg.VIT.STEM_TYPE,
            c_stem_kernels=tuple(cfg.VIT.C_STEM_KERNELS),
            c_stem_strides=tuple(cfg.VIT.C_STEM_STRIDES),
            c_stem_dims=tuple(cfg.VIT.C_STEM_DIMS),
            n_layers=cfg.VIT.NUM_LAYERS,
            n_heads=cfg.VIT.NUM_HEADS,
            hidden_d=cfg.VIT.HIDDEN_DIM,
            mlp_d=cfg.VIT.MLP_DIM,
            cls_type=cfg.VIT.CLASSIFIER_TYPE,
            num_classes=cfg.MODEL.NUM_CLASSES,
            ln_eps=cfg.LN.EPS,
            bn_eps=cfg.BN.EPS,
            bn_mom=cfg.BN.MOM,
            relu_inplace=cfg.MODEL.ACTIVATION_INPLACE,
            batch_first=cfg.VIT.LAYOUT == "batch_first",
            attention=cfg.VIT.ATTENTION,
            drop_path=cfg.VIT.DROP_PATH,
            layer_scale=cfg.VIT.LAYER_SCALE,
            distill_token=cfg.VIT.DISTILL_TOKEN,
            qk_norm=cfg.VIT.QK_NORM,
            attention_fp32=cfg.VIT.ATTENTION_FP32,
        )

    @property
    def num_prefix(self) -> int:
        """Tokens before the patches: the class token, then DeiT's distillation
        token."""
        return int(self.cls_type == "token") + int(self.distill_token)

    @property
    def seq_len(self) -> int:
        """Number of tokens: patches, plus the class and distillation tokens."""
        return (self.image_size // self.patch_size) ** 2 + self.num_prefix


class ViTHead(nn.Module):
    """Classifier: one fc layer."""

    def __init__(self, w_in: int, num_classes: int) -> None:
        super().__init__()
        self.head_fc = linear(w_in, num_classes, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (batch, w_in) float -> logits (batch, num_classes), same dtype."""
        return self.head_fc(x)

    @staticmethod
    def complexity(cx: dict[str, int], w_in: int, num_classes: int) -> dict[str, int]:
        return linear_cx(cx, w_in, num_classes, bias=True)


class MLPBlock(nn.Module):
    """Transformer MLP block: fc, gelu, fc."""

    def __init__(self, w_in: int, mlp_d: int) -> None:
        super().__init__()
        self.linear_1 = linear(w_in, mlp_d, bias=True)
        self.af = nn.GELU()
        self.linear_2 = linear(mlp_d, w_in, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (..., w_in) float -> (..., w_in), same dtype (any token layout)."""
        return self.linear_2(self.af(self.linear_1(x)))

    @staticmethod
    def complexity(
        cx: dict[str, int], w_in: int, mlp_d: int, seq_len: int
    ) -> dict[str, int]:
        cx = linear_cx(cx, w_in, mlp_d, bias=True, num_locations=seq_len)
        return linear_cx(cx, mlp_d, w_in, bias=True, num_locations=seq_len)


class MultiheadSelfAttention(nn.Module):
    """Self-attention with a fused q/k/v projection, for either token layout.

    `qk_norm`: a LayerNorm over each head's queries and keys before the dot product
    (ViT-22B; timm's `qk_norm`), which bounds the attention logits. `fp32`: the
    attention itself (logits, softmax, weighted sum) in float32 under autocast."""

    def __init__(
        self,
        hidden_d: int,
        n_heads: int,
        *,
        batch_first: bool,
        attention: str = "auto",
        qk_norm: bool = False,
        ln_eps: float = 1e-6,
        fp32: bool = False,
    ) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.batch_first = batch_first
        self.attention = attention
        self.fp32 = fp32
        self.attn_proj = linear(hidden_d, 3 * hidden_d, bias=True)
        self.out_proj = linear(hidden_d, hidden_d, bias=True)
        head_d = hidden_d // n_heads
        self.q_norm = layernorm(head_d, ln_eps) if qk_norm else nn.Identity()
        self.k_norm = layernorm(head_d, ln_eps) if qk_norm else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (batch, seq, hidden) if batch_first else (seq, batch, hidden), float;
        returns the same shape and dtype."""
        d0, d1 = x.shape[:2]
        # Widths come from the projection's output, not from hidden_d: a module that
        # holds a slice of the heads (and of attn_proj's rows) runs this code as it is.
        qkv = self.attn_proj(x)
        qkv = qkv.view(d0, d1, 3, self.n_heads, qkv.size(-1) // (3 * self.n_heads))
        # Both layouts gather q, k, v as (3, batch, heads, seq, head_d) for the kernel.
        perm = (2, 0, 3, 1, 4) if self.batch_first else (2, 1, 3, 0, 4)
        q, k, v = qkv.permute(perm).unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        if self.fp32:
            with torch.autocast(x.device.type, enabled=False):
                out = attend(q.float(), k.float(), v.float(), self.attention)
            out = out.to(v.dtype)
        else:
            out = attend(q, k, v, self.attention)
        # (batch, heads, seq, head_d) -> the input layout
        out = out.permute(0, 2, 1, 3) if self.batch_first else out.permute(2, 0, 1, 3)
        return self.out_proj(out.reshape(d0, d1, -1))

    @staticmethod
    def complexity(
        cx: dict[str, int],
        hidden_d: int,
        n_heads: int,
        seq_len: int,
        qk_norm: bool = False,
    ) -> dict[str, int]:
        head_d = hidden_d // n_heads
        # q, k, v = attn_proj(x)
        cx = linear_cx(cx, hidden_d, 3 * hidden_d, bias=True, num_locations=seq_len)
        if qk_norm:  # q_norm, k_norm: one LayerNorm over head_d each
            cx = layernorm_cx(layernorm_cx(cx, head_d), head_d)
        # scores = q @ k^T, per head
        cx["flops"] += n_heads * seq_len * head_d * seq_len
        cx["acts"] += n_heads * seq_len * seq_len
        # out = scores @ v, per head
        cx["flops"] += n_heads * seq_len * seq_len * head_d
        cx["acts"] += n_heads * seq_len * head_d
        # out_proj(out)
        return linear_cx(cx, hidden_d, hidden_d, bias=True, num_locations=seq_len)


class LayerScale(nn.Module):
    """DeiT III's LayerScale: a learned per-channel scale `gamma` of a residual
    branch, initialised small (https://arxiv.org/abs/2103.17239)."""

    def __init__(self, dim: int, init_value: float) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.full((dim,), float(init_value)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (..., dim), float -> the same shape, scaled per channel."""
        return x * self.gamma

    @staticmethod
    def complexity(cx: dict[str, int], dim: int) -> dict[str, int]:
        # Parameters only: pycls counts no flops or acts for elementwise layers.
        return {**cx, "params": cx["params"] + dim}


class ViTEncoderBlock(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x)); with
    p.layer_scale > 0 each branch is scaled by a LayerScale (DeiT III)."""

    def __init__(self, p: ViTParams, drop_path_prob: float = 0.0) -> None:
        super().__init__()
        self.ln_1 = layernorm(p.hidden_d, p.ln_eps)
        self.self_attention = MultiheadSelfAttention(
            p.hidden_d,
            p.n_heads,
            batch_first=p.batch_first,
            attention=p.attention,
            qk_norm=p.qk_norm,
            ln_eps=p.ln_eps,
            fp32=p.attention_fp32,
        )
        self.ln_2 = layernorm(p.hidden_d, p.ln_eps)
        self.mlp_block = MLPBlock(p.hidden_d, p.mlp_d)
        if p.layer_scale > 0:
            self.ls_1 = LayerScale(p.hidden_d, p.layer_scale)
            self.ls_2 = LayerScale(p.hidden_d, p.layer_scale)
        else:
            self.ls_1 = self.ls_2 = nn.Identity()
        self.drop_path_prob = drop_path_prob
        self.batch_dim = 0 if p.batch_first else 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: tokens (seq, batch, hidden) or (batch, seq, hidden) per the layout, float;
        returns the same shape and dtype."""
        dp, bd = self.drop_path_prob, self.batch_dim
        attn = self.ls_1(self.self_attention(self.ln_1(x)))
        x = x + drop_path(attn, dp, self.training, bd)
        mlp = self.ls_2(self.mlp_block(self.ln_2(x)))
        return x + drop_path(mlp, dp, self.training, bd)

    @staticmethod
    def complexity(
        cx: dict[str, int],
        hidden_d: int,
        n_heads: int,
        mlp_d: int,
        seq_len: int,
        layer_scale: bool = False,
        qk_norm: bool = False,
    ) -> dict[str, int]:
        cx = layernorm_cx(cx, hidden_d)
        cx = MultiheadSelfAttention.complexity(cx, hidden_d, n_heads, seq_len, qk_norm)
        cx = layernorm_cx(cx, hidden_d)
        cx = MLPBlock.complexity(cx, hidden_d, mlp_d, seq_len)
        if layer_scale:
            cx = LayerScale.complexity(LayerScale.complexity(cx, hidden_d), hidden_d)
        return cx


class ViTEncoder(nn.Module):
    """Encoder blocks, then the final LayerNorm."""

    def __init__(self, p: ViTParams) -> None:
        super().__init__()
        for i in range(p.n_layers):
            # Stochastic depth grows linearly to p.drop_path at the last block (timm).
            rate = p.drop_path * i / max(p.n_layers - 1, 1)
            self.add_module(f"block_{i}", ViTEncoderBlock(p, rate))
        self.ln = layernorm(p.hidden_d, p.ln_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: tokens (seq, batch, hidden) or (batch, seq, hidden) per the layout, float;
        returns the same shape and dtype. Runs the blocks (and LayerNorm) it holds: a
        pipeline stage's copy holds some of them."""
        for block in self.children():
            x = block(x)
        return x

    @staticmethod
    def complexity(
        cx: dict[str, int],
        n_layers: int,
        hidden_d: int,
        n_heads: int,
        mlp_d: int,
        seq_len: int,
        layer_scale: bool = False,
        qk_norm: bool = False,
    ) -> dict[str, int]:
        for _ in range(n_layers):
            cx = ViTEncoderBlock.complexity(
                cx, hidden_d, n_heads, mlp_d, seq_len, layer_scale, qk_norm
            )
        return layernorm_cx(cx, hidden_d)


class ViTStemPatchify(nn.Module):
    """Patchify stem (https://arxiv.org/abs/2010.11929)."""

    def __init__(self, w_in: int, w_out: int, k: int) -> None:
        super().__init__()
        self.patchify = patchify2d(w_in, w_out, k, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: images (batch, w_in, h, w), float -> (batch, w_out, h // k, w // k)."""
        return self.patchify(x)

    @staticmethod
    def complexity(cx: dict[str, int], w_in: int, w_out: int, k: int) -> dict[str, int]:
        return patchify2d_cx(cx, w_in, w_out, k, bias=True)


class ViTStemConv(nn.Module):
    """Conv stem (https://arxiv.org/abs/2106.14881): 3x3 conv-BN-ReLU layers, then a
    last conv (typically 1x1) to the hidden width."""

    def __init__(
        self,
        w_in: int,
        ks: Sequence[int],
        ws: Sequence[int],
        ss: Sequence[int],
        *,
        bn_eps: float = 1e-5,
        bn_mom: float = 0.1,
        inplace: bool = True,
    ) -> None:
        super().__init__()
        for i, (k, w_out, stride) in enumerate(zip(ks, ws, ss)):
            if i < len(ks) - 1:
                self.add_module(f"cstem{i}_conv", conv2d(w_in, w_out, 3, stride=stride))
                self.add_module(f"cstem{i}_bn", norm2d(w_out, bn_eps, bn_mom))
                self.add_module(f"cstem{i}_af", nn.ReLU(inplace=inplace))
            else:
                last = conv2d(w_in, w_out, k, stride=stride, bias=True)
                self.add_module("cstem_last_conv", last)
            w_in = w_out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: images (batch, w_in, h, w), float -> (batch, ws[-1], h', w'),
        same dtype."""
        for layer in self.children():
            x = layer(x)
        return x

    @staticmethod
    def complexity(
        cx: dict[str, int],
        w_in: int,
        ks: Sequence[int],
        ws: Sequence[int],
        ss: Sequence[int],
    ) -> dict[str, int]:
        for i, (k, w_out, stride) in enumerate(zip(ks, ws, ss)):
            if i < len(ks) - 1:
                cx = conv2d_cx(cx, w_in, w_out, 3, stride=stride)
                cx = norm2d_cx(cx, w_out)
            else:
                cx = conv2d_cx(cx, w_in, w_out, k, stride=stride, bias=True)
            w_in = w_out
        return cx


class ViT(nn.Module):
    """Vision transformer: stem, tokens (+ class token) + positions, encoder, head.

    forward: images (batch, 3, image_size, image_size), float -> logits
    (batch, num_classes), in the compute dtype. With DeiT's distillation token
    (p.distill_token) a second head reads that token: in training forward returns
    (class-token logits, distillation-token logits), in eval their mean.
    """

    def __init__(self, p: ViTParams) -> None:
        super().__init__()
        self.params = p
        self.batch_first = p.batch_first
        # One draw of torch's global generator, whatever the device: built on the
        # meta device (to be sharded first) or not, the run's RNG stream goes on
        # alike, and `init_weights` (or a sharded model's materialization) fills
        # every tensor from this seed and the tensor's name.
        self.init_seed = init_seed()
        target = torch.get_default_device()
        with torch.device("meta"):  # no default init to draw and overwrite
            self._build(p)
        if target.type != "meta":
            self.to_empty(device=target)
            self.init_weights()

    def _build(self, p: ViTParams) -> None:
        if p.stem_type == "patchify":
            self.stem = ViTStemPatchify(3, p.hidden_d, p.patch_size)
        else:
            self.stem = ViTStemConv(
                3,
                p.c_stem_kernels,
                p.c_stem_dims,
                p.c_stem_strides,
                bn_eps=p.bn_eps,
                bn_mom=p.bn_mom,
                inplace=p.relu_inplace,
            )
        if p.cls_type == "token":
            self.class_token = nn.Parameter(torch.zeros(1, 1, p.hidden_d))
        else:
            self.class_token = None
        if p.distill_token:
            self.dist_token = nn.Parameter(torch.zeros(1, 1, p.hidden_d))
            self.head_dist = ViTHead(p.hidden_d, p.num_classes)
        else:
            self.dist_token = self.head_dist = None
        # Stored (1, seq, hidden) in both layouts, so checkpoints do not depend on it.
        self.pos_embedding = nn.Parameter(torch.zeros(1, p.seq_len, p.hidden_d))
        self.encoder = ViTEncoder(p)
        self.head = ViTHead(p.hidden_d, p.num_classes)

    @torch.no_grad()
    def init_weights(self) -> None:
        """Fills every parameter and buffer with pycls main's init (`init_tensor`),
        drawn from `init_seed` and the tensor's name."""
        tensors = [*self.named_parameters(), *self.named_buffers()]
        for name, t in tensors:
            if t.device.type == "cpu":
                init_tensor(self.params, name, t, self.init_seed)
            else:  # CPU draws: the same values on every kind of device
                full = torch.empty_like(t, device="cpu")
                init_tensor(self.params, name, full, self.init_seed)
                t.copy_(full)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A pipeline stage is a copy of the model with the parts of other stages set
        # to None (torchtitan's way): each part runs only where it is held.
        if self.stem is not None:
            x = self.embed(x)
        if self.encoder is not None:
            x = self.encoder(x)
        if self.head is not None:
            x = self.classify(x)
        return x

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """images (batch, 3, h, w), float -> tokens with positions, (seq, batch,
        hidden) or (batch, seq, hidden) per the layout."""
        # (n, c, h, w) -> (n, hidden_d, n_h, n_w) -> (n, hidden_d, n_h * n_w)
        x = self.stem(x).flatten(2)
        # One copy to a contiguous token tensor here: left strided, the residual stream
        # stays strided through every block, so that each LayerNorm (forward and
        # backward) copies it and each residual add runs on strided memory.
        prefix = [t for t in (self.class_token, self.dist_token) if t is not None]
        pos = self.positions(x.size(-1))
        if self.batch_first:
            x = x.transpose(1, 2).contiguous()  # (n, seq, hidden_d)
            if prefix:
                x = torch.cat([t.expand(x.size(0), -1, -1) for t in prefix] + [x], 1)
            return x + pos
        x = x.permute(2, 0, 1).contiguous()  # (seq, n, hidden_d)
        if prefix:
            x = torch.cat([t.expand(-1, x.size(1), -1) for t in prefix] + [x], 0)
        return x + pos.transpose(0, 1)

    def positions(self, n_patches: int) -> torch.Tensor:
        """The position embedding (1, seq, hidden) for `n_patches` patches: the
        stored one at the built size, else its patch grid resampled (bicubic, timm's
        `resample_abs_pos_embed`, differentiable) for an image of another size (a
        progressive-resolution stage, TRAIN.SIZE_SCHEDULE)."""
        prefix = self.params.num_prefix
        if self.pos_embedding.size(1) == prefix + n_patches:
            return self.pos_embedding
        from timm.layers import resample_abs_pos_embed

        side = math.isqrt(n_patches)
        return resample_abs_pos_embed(
            self.pos_embedding, [side, side], num_prefix_tokens=prefix
        )

    def classify(self, x: torch.Tensor) -> torch.Tensor:
        """Encoded tokens (per the layout) -> logits (batch, num_classes); with the
        distillation token see the class docstring."""
        cls, dist = self.params.cls_type == "token", self.params.distill_token
        if self.batch_first:
            tokens = x[:, 0] if cls else x.mean(dim=1)
            dist = x[:, 1] if dist else None
        else:
            tokens = x[0] if cls else x.mean(dim=0)
            dist = x[1] if dist else None
        if dist is None:
            return self.head(tokens)
        logits, dist_logits = self.head(tokens), self.head_dist(dist)
        if self.training:
            return logits, dist_logits
        return (logits + dist_logits) / 2

    @staticmethod
    def complexity(p: ViTParams) -> dict[str, int]:
        """Returns {params, flops, acts} of the model (pycls conventions)."""
        cx = {"h": p.image_size, "w": p.image_size, "flops": 0, "params": 0, "acts": 0}
        if p.stem_type == "patchify":
            cx = ViTStemPatchify.complexity(cx, 3, p.hidden_d, p.patch_size)
        else:
            ks, ws, ss = p.c_stem_kernels, p.c_stem_dims, p.c_stem_strides
            cx = ViTStemConv.complexity(cx, 3, ks, ws, ss)
        cx["params"] += p.num_prefix * p.hidden_d  # class and distillation tokens
        cx["params"] += p.seq_len * p.hidden_d  # position embeddings
        cx = ViTEncoder.complexity(
            cx,
            p.n_layers,
            p.hidden_d,
            p.n_heads,
            p.mlp_d,
            p.seq_len,
            p.layer_scale > 0,
            p.qk_norm,
        )
        cx = ViTHead.complexity(cx, p.hidden_d, p.num_classes)
        if p.distill_token:
            cx = ViTHead.complexity(cx, p.hidden_d, p.num_classes)
        return {"params": cx["params"], "flops": cx["flops"], "acts": cx["acts"]}


def init_seed() -> int:
    """The seed of a model's init: one draw of torch's global CPU generator (so
    `torch.manual_seed` decides it, as it decided torch's own init)."""
    return int(torch.randint(0, 2**62, (), device="cpu"))


def tensor_generator(seed: int, name: str) -> torch.Generator:
    """A CPU generator seeded by (`seed`, the tensor's state-dict name) alone: a
    tensor's initial values depend on nothing else built before or beside it."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)


def init_tensor(p: ViTParams, name: str, t: torch.Tensor, seed: int) -> None:
    """Fills `t`, the whole CPU tensor of the parameter or buffer `name` (its
    state-dict name) of a ViT of `p`, with its init, drawn from
    `tensor_generator(seed, name)` in the dtype `t` has.

    The init of pycls main (commit 484bb29, "Use batch-second tensor layout in
    ViT", and unchanged since): truncated-normal patchify with std sqrt(1 / fan_in),
    He-normal 3x3 conv-stem convs, std sqrt(1 / w_out) for the stem's last conv,
    normal(0.02) position embedding, zero class token and head; the MLP's weights
    Xavier-uniform with normal(1e-6) biases; the attention projections what pycls's
    torch.nn.MultiheadAttention gets by default: Xavier-uniform qkv with zero bias,
    torch's default (Kaiming-uniform, a = sqrt(5)) out-projection weight with zero
    bias. Norms: ones and zeros; LayerScale: VIT.LAYER_SCALE; DeiT's distillation
    token: truncated normal(0.02)."""
    g = tensor_generator(seed, name)
    module, _, leaf = name.rpartition(".")
    module = module.rpartition(".")[2]  # the owning module's own name
    norm = module in ("ln", "ln_1", "ln_2", "q_norm", "k_norm") or module.endswith(
        "_bn"
    )
    if name == "pos_embedding":
        init.normal_(t, mean=0.0, std=0.02, generator=g)
    elif name == "dist_token":
        init.trunc_normal_(t, std=0.02, generator=g)
    elif name == "class_token" or module == "head_fc":
        init.zeros_(t)
    elif leaf == "gamma":  # LayerScale
        init.constant_(t, p.layer_scale)
    elif leaf in ("running_mean", "num_batches_tracked"):
        init.zeros_(t)
    elif leaf == "running_var":
        init.ones_(t)
    elif leaf == "bias" and module in ("linear_1", "linear_2"):
        init.normal_(t, std=1e-6, generator=g)
    elif leaf == "bias":
        init.zeros_(t)
    elif leaf != "weight":
        raise ValueError(f"no init for ViT tensor {name}")
    elif norm:
        init.ones_(t)
    elif module in ("attn_proj", "linear_1", "linear_2"):
        init.xavier_uniform_(t, generator=g)
    elif module == "out_proj":
        init.kaiming_uniform_(t, a=math.sqrt(5), generator=g)
    elif module == "patchify":
        fan_in = t.shape[1] * t.shape[2] * t.shape[3]
        init.trunc_normal_(t, std=math.sqrt(1.0 / fan_in), generator=g)
    elif module == "cstem_last_conv":
        init.normal_(t, mean=0.0, std=math.sqrt(1.0 / t.shape[0]), generator=g)
    elif module.startswith("cstem") and module.endswith("_conv"):
        init.normal_(t, mean=0.0, std=math.sqrt(2.0 / t.shape[0]), generator=g)
    else:
        raise ValueError(f"no init for ViT tensor {name}")
