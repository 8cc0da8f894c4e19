"""Mixed precision: the AMP modes and what each does to the model, forward and step.

- fp32: everything in fp32.
- O1: autocast (matmuls in half precision), fp32 weights. pycls's
  TRAIN.MIXED_PRECISION: True means this (when AMP.MODE is not set).
- O2: half-precision model weights, fp32 master weights kept by the optimizer
  (`MasterWeights`); LayerNorm stays fp32 when AMP.LAYER_NORM_FP32 (autocast keeps the
  LayerNorm math in fp32 and the matmuls in half precision).
- O3: everything in half precision, no master copy ("full FP16").

fp16 uses dynamic loss scaling (`GradScaler`), bf16 needs none.
"""

import contextlib
import enum
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from yacs.config import CfgNode

from pycls_fast.config import legacy_amp_mode
from pycls_fast.runtime.distributed import local_tensor


def apply_backend_flags(cfg: CfgNode) -> None:
    """Sets this process's CUDA math flags once, at setup: fp32 matmuls and cuDNN
    convolutions in TF32 (AMP.TF32) or IEEE fp32, and cuDNN autotuning
    (CUDNN.BENCHMARK). Harmless on a CPU (the flags concern CUDA only).

    Matmuls go through torch.set_float32_matmul_precision, which sets the CUDA
    matmul's `fp32_precision` and keeps torch.get_float32_matmul_precision()
    readable (inductor's max-autotune reads it; setting only the backend flag made
    it raise). The CPU's (oneDNN) matmul setting is kept as it was: CPU math does
    not change. Convolutions: cuDNN's `fp32_precision`. No legacy `allow_tf32` flag
    is touched: torch refuses to read a flag once both APIs were used."""
    cpu_matmul = torch.backends.mkldnn.matmul.fp32_precision
    torch.set_float32_matmul_precision("high" if cfg.AMP.TF32 else "highest")
    torch.backends.mkldnn.matmul.fp32_precision = cpu_matmul
    torch.backends.cudnn.conv.fp32_precision = "tf32" if cfg.AMP.TF32 else "ieee"
    torch.backends.cudnn.benchmark = cfg.CUDNN.BENCHMARK


def fp32_math() -> str:
    """How fp32 matmuls run on CUDA now: 'tf32' or 'ieee' (torch's setting)."""
    return torch.backends.cuda.matmul.fp32_precision


class AmpMode(enum.Enum):
    """The precision modes of AMP.MODE."""

    FP32 = "fp32"
    O1 = "O1"
    O2 = "O2"
    O3 = "O3"


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_amp(cfg: CfgNode) -> tuple[AmpMode, torch.dtype]:
    """Returns (AmpMode, half dtype): AMP.MODE, or for AMP.MODE '' (a config built
    from get_cfg(), not loaded) what pycls's aliases ask for (config.legacy_amp_mode).

    A loaded config holds the resolved mode already (config.load_cfg applies the rule:
    an AMP.MODE set in the file or an override wins over the aliases). The half dtype
    is AMP.DTYPE's even in fp32 mode, where nothing uses it: `describe_precision`
    names the pair for logs.
    """
    mode = cfg.AMP.MODE or legacy_amp_mode(cfg)
    return AmpMode(mode), DTYPES[cfg.AMP.DTYPE]


def describe_precision(mode: AmpMode, half: torch.dtype) -> str:
    """The precision of a run in words, for logs: 'fp32', or e.g.
    'O1 (bf16 autocast, fp32 weights)'."""
    name = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(half, str(half))
    return {
        AmpMode.FP32: "fp32",
        AmpMode.O1: f"O1 ({name} autocast, fp32 weights)",
        AmpMode.O2: f"O2 ({name} weights, fp32 master weights)",
        AmpMode.O3: f"O3 ({name} everywhere)",
    }[mode]


def prepare_model(
    model: nn.Module, mode: AmpMode, dtype: torch.dtype, layer_norm_fp32: bool = True
) -> nn.Module:
    """Casts the model's parameters and buffers for `mode` (in place); returns it."""
    if mode in (AmpMode.O2, AmpMode.O3):
        model.to(dtype)
        if mode is AmpMode.O2 and layer_norm_fp32:
            for m in model.modules():
                if isinstance(m, (nn.LayerNorm, nn.BatchNorm2d)):
                    m.float()
    return model


def at_least_fp32(t: torch.Tensor) -> torch.Tensor:
    """`t` in float32 if it is in half precision, else unchanged (a float64 model's
    logits keep their precision: the parity tests compare layouts in float64)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def input_dtype(mode: AmpMode, dtype: torch.dtype) -> torch.dtype:
    """The dtype images are normalized to for the model's first layer."""
    return dtype if mode in (AmpMode.O2, AmpMode.O3) else torch.float32


def autocast(
    device_type: str, mode: AmpMode, dtype: torch.dtype, cache: bool = True
) -> contextlib.AbstractContextManager:
    """The autocast context of a forward pass in `mode`.

    O1 autocasts; O2 autocasts too so that fp32 LayerNorms meet half-precision
    activations (autocast runs layer_norm in fp32 and matmuls in half precision);
    O3 and fp32 need none. `cache`: autocast's weight cache, which keeps the
    half-precision copy of every weight it casts until the context ends. Under FSDP
    that is a copy of the whole (tensor-parallel-local) model on every rank,
    gathered block by block and never freed with the block: `weight_cache` says
    when to turn it off.
    """
    if mode in (AmpMode.O1, AmpMode.O2):
        return torch.autocast(device_type, dtype=dtype, cache_enabled=cache)
    return contextlib.nullcontext()


def weight_cache(cfg: CfgNode) -> bool:
    """Whether `autocast` keeps its weight cache for `cfg`'s runs: not under FSDP.

    FSDP gathers a block's weights for its forward and frees them after; the cache
    would keep their half-precision casts to the end of the forward (a pipeline's
    whole step), a half copy of the rank's whole model, whatever FSDP shards. Off,
    a cast lives as long as the matmul that saved it for backward: with activation
    checkpointing, one block's. The cost is a cast per use instead of per step
    (a pipeline stage's micro-batches each cast again), small next to the matmuls.
    Without FSDP the cache holds the casts that backward keeps anyway.
    """
    return not cfg.FSDP.ENABLED


class MasterWeights:
    """fp32 master copies of half-precision parameters, for AMP O2.

    The optimizer steps on the fp32 copies: `grads_to_master()` after backward,
    `master_to_model()` after the step. Parameters already in fp32 (LayerNorm kept in
    fp32) are used as they are.
    """

    def __init__(self, params: Iterable[nn.Parameter]) -> None:
        self.model_params = [p for p in params if p.requires_grad]
        self.master_params = [
            p if p.dtype == torch.float32 else p.detach().float().requires_grad_()
            for p in self.model_params
        ]
        self._by_param = {
            id(p): m for p, m in zip(self.model_params, self.master_params)
        }
        self._pairs = [
            (m, p) for m, p in zip(self.master_params, self.model_params) if m is not p
        ]
        # fp32 gradient buffers of the masters, made at the first step: the
        # optimizer's zero_grad(set_to_none) drops the masters' .grad each step.
        self._grads: list[torch.Tensor] | None = None

    def master_for(self, param: nn.Parameter) -> torch.Tensor:
        """The fp32 parameter the optimizer should update in place of `param`."""
        return self._by_param[id(param)]

    def fp32_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """`model`'s state dict with each half-precision parameter replaced by its
        fp32 master (what the EMA follows: an EMA of the bf16 roundings would
        lose the master's low bits)."""
        state = model.state_dict(keep_vars=True)
        return {k: self._by_param.get(id(t), t).detach() for k, t in state.items()}

    @torch.no_grad()
    def grads_to_master(self) -> None:
        """Copies the model's half-precision grads to the master params (as fp32) in
        one multi-tensor kernel and drops the model's."""
        if not self._pairs:
            return
        halves = [p.grad for _, p in self._pairs]
        if any(g is None for g in halves):
            # A parameter without a gradient (unused in this forward): its master
            # gets none either, so the optimizer leaves it alone.
            for m, p in self._pairs:
                m.grad = None if p.grad is None else p.grad.float()
                p.grad = None
            return
        if self._grads is None:
            self._grads = [torch.empty_like(m) for m, _ in self._pairs]
        torch._foreach_copy_(self._grads, halves)
        for (m, p), g in zip(self._pairs, self._grads):
            m.grad = g
            p.grad = None

    @torch.no_grad()
    def master_to_model(self) -> None:
        """Copies the updated fp32 master weights back into the model."""
        if self._pairs:
            torch._foreach_copy_(
                [p for _, p in self._pairs], [m for m, _ in self._pairs]
            )

    def state_dict(self) -> dict[str, list[torch.Tensor]]:
        return {"master": [m.detach().clone() for m, _ in self._pairs]}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, list[torch.Tensor]]) -> None:
        for (m, _), saved in zip(self._pairs, state["master"]):
            m.copy_(saved)
        self.master_to_model()


class LossScaler:
    """Dynamic loss scaling for fp16 (all modes, O3's fp16 grads included).

    `scale(loss)` before backward; `unscale_(params)` after it divides the grads by the
    scale and returns a device flag (0-d float32 tensor, 1.0 when any grad is
    inf/NaN: the step must then be skipped); `step(optimizer, found_inf)` skips it;
    `update(found_inf)` halves the scale after an overflow and doubles it after
    `growth_interval` clean steps. Disabled (bf16, fp32) it does nothing. Under
    torch.distributed the overflow flag is reduced across ranks, so that all ranks
    skip the same steps (sharded grads overflow on one rank only).

    The scale, the count of clean steps and of skipped steps live on the device, so
    that a step reads nothing back to the host: the fused optimizers skip on the
    flag themselves; other optimizers need one read of it per step.
    """

    def __init__(
        self, enabled: bool, init_scale: float = 2.0**16, growth_interval: int = 2000
    ) -> None:
        self.enabled = enabled
        self.growth_interval = growth_interval
        self._init_scale = init_scale if enabled else 1.0
        self._scale: torch.Tensor | None = None  # (1,) float32, on the device
        self._clean: torch.Tensor | None = None  # (1,) int32: clean steps in a row
        self._skipped: torch.Tensor | None = None  # (1,) float32: steps skipped
        self._pending: dict[str, Any] | None = None  # a state loaded before use
        # Optimizers past a clean first step (weak: an id could be reused).
        self._fused_ready: weakref.WeakSet = weakref.WeakSet()

    def _on(self, device: torch.device) -> None:
        if self._scale is not None and self._scale.device == device:
            return
        state = self._pending or (self.state_dict() if self._scale is not None else {})
        self._pending = None
        self._scale = torch.full(
            (1,), float(state.get("scale", self._init_scale)), device=device
        )
        # torch's growth tracker restarts at each growth (older checkpoints counted on).
        clean = int(state.get("clean_steps", 0)) % self.growth_interval
        self._clean = torch.full((1,), clean, dtype=torch.int32, device=device)
        self._skipped = torch.full(
            (1,), float(state.get("skipped_steps", 0)), device=device
        )

    @property
    def scale_value(self) -> float:
        """The current scale (reads it from the device)."""
        if self._scale is None:
            state = self._pending or {}
            return float(state.get("scale", self._init_scale))
        return float(self._scale.item())

    @scale_value.setter
    def scale_value(self, value: float) -> None:
        if self._scale is None:
            self._init_scale = float(value)
            if self._pending:
                self._pending["scale"] = float(value)
        else:
            self._scale.fill_(value)

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for an overflow so far (reads it from the device)."""
        if self._skipped is None:
            return int((self._pending or {}).get("skipped_steps", 0))
        return int(self._skipped.item())

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss`: float scalar tensor; returns it times the scale (same dtype)."""
        if not self.enabled:
            return loss
        self._on(loss.device)
        return loss * self._scale.to(loss.dtype)

    @torch.no_grad()
    def unscale_(self, params: Iterable[nn.Parameter]) -> torch.Tensor | None:
        """Unscales the grads of `params` in place; returns the overflow flag, a 0-d
        float32 device tensor (1.0: inf/NaN found), or None when disabled."""
        if not self.enabled:
            return None
        # FSDP's grads are DTensors: unscale this rank's shards (the overflow flag is
        # reduced across ranks below).
        grads = [local_tensor(p.grad) for p in params if p.grad is not None]
        device = grads[0].device if grads else torch.device("cpu")
        self._on(device)
        found_inf = torch.zeros((), device=device)
        inv_scale = self._scale.double().reciprocal().float()
        by_dtype = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        for group in by_dtype.values():
            torch._amp_foreach_non_finite_check_and_unscale_(
                group, found_inf, inv_scale
            )
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(found_inf, op=torch.distributed.ReduceOp.MAX)
        return found_inf

    def step(
        self, optimizer: torch.optim.Optimizer, found_inf: torch.Tensor | None
    ) -> bool:
        """optimizer.step() unless `found_inf` is set. Fused optimizers take the flag
        and skip on the device (torch's GradScaler contract: `found_inf` as an
        attribute, grads already unscaled) once a clean step has created their
        state; others, and fused ones until then, read it (one host sync). Returns
        whether the step was taken on the host's knowledge (True for fused)."""
        if found_inf is None:
            optimizer.step()
            return True
        if (
            getattr(optimizer, "_step_supports_amp_scaling", False)
            and optimizer in self._fused_ready
        ):
            optimizer.found_inf = found_inf
            try:
                optimizer.step()
            finally:
                del optimizer.found_inf
            return True
        if found_inf.item():
            return False
        optimizer.step()
        # A fused kernel creates its lazy state on its first step (SGD's momentum
        # with empty_like) and, on found_inf, returns before filling it: the next
        # step would read garbage as momentum. So fused optimizers skip on the
        # device only once a clean step has created their state.
        self._fused_ready.add(optimizer)
        return True

    def update(self, found_inf: torch.Tensor | None) -> None:
        """Backs off after an overflow, grows after `growth_interval` clean steps (on
        the device, torch's `_amp_update_scale_`)."""
        if not self.enabled or found_inf is None:
            return
        self._on(found_inf.device)
        self._skipped.add_(found_inf)
        torch._amp_update_scale_(
            self._scale, self._clean, found_inf, 2.0, 0.5, self.growth_interval
        )

    def state_dict(self) -> dict[str, Any]:
        if self._scale is None:
            return dict(
                self._pending
                or {"scale": self._init_scale, "clean_steps": 0, "skipped_steps": 0}
            )
        return {
            "scale": float(self._scale.item()),
            "clean_steps": int(self._clean.item()),
            "skipped_steps": int(self._skipped.item()),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._pending = {
            "scale": float(state["scale"]),
            "clean_steps": int(state["clean_steps"]),
            "skipped_steps": int(state["skipped_steps"]),
        }
        device = self._scale.device if self._scale is not None else None
        self._scale = None
        if device is not None:
            self._on(device)


def loss_scaler(dtype: torch.dtype) -> LossScaler:
    """The loss scaler for a half dtype: dynamic for fp16, disabled otherwise."""
    return LossScaler(enabled=dtype == torch.float16)
