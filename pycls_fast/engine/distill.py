"""DeiT's knowledge distillation: the teacher, and the distillation loss.

    distiller = build_distiller(cfg, device, mode, half)   # None when DISTILL.TYPE none
    teacher_logits = distiller.teacher_logits(inputs)       # inside the step's autocast
    loss = distiller.loss(base_loss_fn, outputs, teacher_logits, targets)

The teacher is a model of DISTILL.TEACHER_CFG with DISTILL.TEACHER_WEIGHTS (a
pycls_fast or pycls checkpoint, or a timm ViT state dict converted on load), at the
student's image size and class count. It runs in eval mode without gradients, in the
training dtype (cast as the student is for the AMP mode). It is built as the student
is (engine/model_setup.py): on the meta device, cast, under FSDP sharded over the
data-parallel ranks, then given this rank's shards only, filled from the weights one
full tensor at a time (a file memory-mapped), so that no rank ever holds the whole
teacher unless it runs it whole: without FSDP (DDP, or TP and PP, which split the
student only) each rank holds the whole teacher for evaluation, its size said in the
log line (`Distiller.note`).
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from yacs.config import CfgNode

from pycls_fast.checkpoint.files import load_checkpoint
from pycls_fast.checkpoint.weights import load_model_weights
from pycls_fast.components.precision import AmpMode, prepare_model
from pycls_fast.config import load_cfg
from pycls_fast.errors import CheckpointError, UserError
from pycls_fast.models import build_model
from pycls_fast.models.timm_compat import from_timm, unwrap_state_dict
from pycls_fast.parallel.data_parallel import fsdp_enabled, shard_model
from pycls_fast.parallel.materialize import copy_full_tensors, named_tensors
from pycls_fast.runtime.distributed import local_tensor


def distillation_loss(
    base: torch.Tensor,
    dist_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    kind: str,
    alpha: float,
    tau: float,
) -> torch.Tensor:
    """DeiT's DistillationLoss: (1 - alpha) x base + alpha x distillation.

    `base`: 0-d loss of the class head; `dist_logits`, `teacher_logits`: float32
    (B, classes). 'soft': KL(student / tau || teacher / tau) x tau^2, summed and
    divided by the logits' element count (DeiT's normalization); 'hard':
    cross-entropy to the teacher's top-1 class."""
    if kind == "soft":
        distill = (
            F.kl_div(
                F.log_softmax(dist_logits / tau, dim=1),
                F.log_softmax(teacher_logits / tau, dim=1),
                reduction="sum",
                log_target=True,
            )
            * (tau * tau)
            / dist_logits.numel()
        )
    else:
        distill = F.cross_entropy(dist_logits, teacher_logits.argmax(dim=1))
    return base * (1 - alpha) + distill * alpha


def _teacher_state(path: str, tcfg: CfgNode):
    """The teacher's state dict when `path` holds timm's ViT names (converted here),
    else None (a pycls_fast or pycls checkpoint: load_model_weights reads it). The
    file is memory-mapped: its tensors are read when taken, not held whole."""
    state = unwrap_state_dict(load_checkpoint(path, mmap=True))
    if isinstance(state, dict) and "patch_embed.proj.weight" in state:
        return from_timm(state, tcfg)
    return None


class Distiller:
    """The teacher and DISTILL.* of a run."""

    def __init__(self, teacher: nn.Module, cfg: CfgNode, note: str) -> None:
        self.teacher = teacher
        self.kind = cfg.DISTILL.TYPE
        self.alpha = cfg.DISTILL.ALPHA
        self.tau = cfg.DISTILL.TAU
        self.note = note

    @torch.no_grad()
    def teacher_logits(self, inputs: torch.Tensor) -> torch.Tensor:
        """inputs: the student's (B, 3, H, W) batch -> teacher logits float32."""
        return self.teacher(inputs).float()

    def loss(
        self,
        base_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        outputs: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        teacher_logits: torch.Tensor,
        targets: torch.Tensor,
    ) -> torch.Tensor:
        """The training loss of a micro-batch: the base loss on the class head and
        distillation on the distillation head (the same head without the token)."""
        logits, dist = outputs if isinstance(outputs, tuple) else (outputs, outputs)
        base = base_loss(logits.float(), targets)
        return distillation_loss(
            base, dist.float(), teacher_logits, self.kind, self.alpha, self.tau
        )


def build_distiller(
    cfg: CfgNode,
    device: torch.device,
    mode: AmpMode,
    half: torch.dtype,
    dp_mesh=None,
) -> Distiller | None:
    """The run's Distiller (teacher built on the meta device, cast, sharded over
    `dp_mesh` (the data-parallel ranks; None: all) under FSDP, then this rank's
    shards filled from the weights), or None."""
    d = cfg.DISTILL
    if d.TYPE == "none":
        return None
    try:
        tcfg = load_cfg(
            d.TEACHER_CFG,
            ["TRAIN.IM_SIZE", str(cfg.TRAIN.IM_SIZE),
             "MODEL.NUM_CLASSES", str(cfg.MODEL.NUM_CLASSES)],
        )  # fmt: skip
    except FileNotFoundError:
        raise UserError(f"DISTILL.TEACHER_CFG not found: {d.TEACHER_CFG}") from None
    with torch.device("meta"):
        teacher = build_model(tcfg)
    teacher.eval().requires_grad_(False)
    prepare_model(teacher, mode, half, cfg.AMP.LAYER_NORM_FP32)
    sharded = fsdp_enabled(cfg)
    if sharded:
        shard_model(teacher, cfg, mode, half, dp_mesh)
    teacher.to_empty(device=device)  # this rank's shards (or all of it), no values
    converted = _teacher_state(d.TEACHER_WEIGHTS, tcfg)
    if converted is not None:
        done = copy_full_tensors(teacher, lambda name, t: converted.get(name))
        missing = sorted(set(dict(named_tensors(teacher))) - set(done))
        if missing:
            raise CheckpointError(
                f"DISTILL.TEACHER_WEIGHTS {d.TEACHER_WEIGHTS} does not fit "
                f"DISTILL.TEACHER_CFG: it lacks {missing[0]}"
            )
        note = f"teacher: timm weights {d.TEACHER_WEIGHTS} converted"
    else:
        note = "teacher: " + load_model_weights(teacher, d.TEACHER_WEIGHTS).describe()
    held = sum(
        local_tensor(t).numel() * local_tensor(t).element_size()
        for _, t in named_tensors(teacher)
    )
    how = "its FSDP shards" if sharded else "whole, replicated for evaluation"
    note += f"; {held / 2**30:.2f} GiB on this rank ({how})"
    return Distiller(teacher, cfg, note)
