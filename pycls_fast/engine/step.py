"""The step: forward, backward and the optimizer's update of one batch.

    loss, logits, found_inf = train_step(parts, inputs, targets)

`forward_backward` runs the batch in TRAIN.ACCUM_STEPS micro-batches (the gradient
reduction of DDP / FSDP after the last only), or through the pipeline's schedule
under PARALLEL.PP; `train_step` adds the fp16 overflow check, the spike guard,
clipping and the update. The checks of a step's loss (`check_finite`,
`spike_skipped`), the step of a rank whose batch lost all its images, and the
evaluation forward (through the pipeline, padded under FSDP) are here too.
`parts` is the run's `Components` (engine/model_setup.py).
"""

import torch
import torch.distributed as dist

from pycls_fast.checkpoint import files
from pycls_fast.components.precision import AmpMode, at_least_fp32, input_dtype
from pycls_fast.errors import NonFiniteLossError
from pycls_fast.parallel.data_parallel import fsdp_enabled
from pycls_fast.parallel.tensor_parallel import (
    average_replicated_grads,
    clip_grad_norm_,
    grad_norm,
)
from pycls_fast.runtime import distributed


def _gradient_sync(model, enabled):
    """Turns the gradient reduction of DDP or FSDP2 on or off for the next backward
    (DDP's `require_backward_grad_sync`, which its `no_sync()` sets; FSDP2's
    `set_requires_gradient_sync`); a plain module has none."""
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(enabled)
    elif hasattr(model, "require_backward_grad_sync"):
        model.require_backward_grad_sync = enabled


def forward_backward(parts, inputs, targets, weight=1.0):
    """Forward and backward of the batch in TRAIN.ACCUM_STEPS micro-batches, each
    loss weighted by its share of the batch (their sum is the batch's mean loss;
    the gradients add up to the whole batch's); returns (loss, logits) detached."""
    if parts.pipeline is not None:
        return _pipeline_forward_backward(parts, inputs, targets, weight)
    steps = parts.cfg.TRAIN.ACCUM_STEPS
    chunks = list(zip(inputs.chunk(steps), targets.chunk(steps)))
    losses, all_logits = [], []
    for i, (x, y) in enumerate(chunks):
        last = i == len(chunks) - 1
        if len(chunks) > 1:
            _gradient_sync(parts.trained, last)  # one reduction, after the last
        with parts.autocast():
            out = parts.trained(x)
            teacher = parts.distiller.teacher_logits(x) if parts.distiller else None
        share = len(y) / len(targets)
        if parts.distiller is not None:
            loss = parts.distiller.loss(parts.loss_fn, out, teacher, y) * share
        else:
            loss = parts.loss_fn(at_least_fp32(out), y) * share
        logits = mean_logits(out)
        parts.scaler.scale(loss * weight if weight != 1.0 else loss).backward()
        losses.append(loss.detach())
        all_logits.append(logits.detach())
    if len(chunks) == 1:
        return losses[0], all_logits[0]
    return torch.stack(losses).sum(), torch.cat(all_logits)


def _pipeline_forward_backward(parts, inputs, targets, weight):
    """The pipeline's forward and backward of the batch (its micro-batches are the
    accumulation); the loss is shared from the last stage with the others, so that
    every rank sees a non-finite loss. Returns (loss, logits) detached; the logits
    are zeros on ranks without the last stage (they count no images)."""
    n = len(targets)
    full = parts.cfg.TRAIN.BATCH_SIZE // parts.layout.dp
    if n < full:
        # A batch short of its bad images: a pipeline's shapes are fixed, so its
        # own images fill it, repeated (they weigh a little more in this step).
        fill = torch.arange(full, device=targets.device) % n
        inputs, targets = inputs[fill], targets[fill]
    unscaled = []

    def loss_fn(out, y):
        loss = parts.loss_fn(at_least_fp32(out), y)
        unscaled.append(loss.detach())
        return parts.scaler.scale(loss * weight if weight != 1.0 else loss)

    with parts.autocast():
        _, logits = parts.pipeline.train(inputs, targets, loss_fn)
    # The micro-batches' losses are the last calls: a stage's first step also calls
    # the loss on the shapes it infers.
    unscaled = unscaled[-parts.pipeline.n_micro :]
    zero = torch.zeros((), device=parts.device)
    loss = torch.stack(unscaled).mean() if unscaled else zero
    dist.all_reduce(loss, group=parts.pipeline.group)  # 0 from the other stages
    if logits is None:
        classes = parts.cfg.MODEL.NUM_CLASSES
        logits = torch.zeros(n, classes, device=parts.device)
    return loss, logits[:n]


def mean_logits(out):
    """The logits of a forward: the mean of the two heads' when a distillation-token
    model returns (class logits, distillation logits) in training (as it does in
    eval), else `out`."""
    return (out[0] + out[1]) / 2 if isinstance(out, tuple) else out


def train_step(parts, inputs, targets, weight=1.0):
    """One optimization step; returns (loss tensor, logits, found_inf).

    inputs: (B, 3, H, W) in the input dtype; targets: (B,) int64 or (B, classes)
    soft targets; with TRAIN.ACCUM_STEPS > 1 they are run in that many micro-batches
    before the step. `weight` scales the loss that is backpropagated (0: this rank
    only takes part in the collectives). found_inf: fp16 loss scaling's overflow
    flag, a 0-d float32 device tensor (1.0: the step was skipped), else None.
    Nothing is read back to the host (fp16 with a non-fused optimizer reads the
    flag)."""
    if parts.cfg.TRAIN.CUDA_GRAPHS:
        # The graphs' outputs of the step before (already read by the meters) may
        # be overwritten from here on: the replays of this step begin.
        torch.compiler.cudagraph_mark_step_begin()
    loss, logits = forward_backward(parts, inputs, targets, weight)
    if parts.tp_replicated:
        average_replicated_grads(parts.tp_replicated, parts.tp_group)
    if parts.master is not None:
        parts.master.grads_to_master()
    # The overflow flag is reduced over every rank (an overflow in any stage or
    # shard skips the step in all of them).
    found_inf = parts.scaler.unscale_(parts.opt_params)
    stages = parts.pipeline.group if parts.pipeline is not None else None
    skip = found_inf
    if parts.spike_guard is not None:
        spike = parts.spike_guard.check(loss, judge=weight != 0)
        skip = spike if found_inf is None else torch.maximum(found_inf, spike)
    if parts.cfg.OPTIM.GRAD_CLIP > 0:
        # After an overflow the clipped grads are NaN too; the step is skipped.
        norm = clip_grad_norm_(parts.opt_params, parts.cfg.OPTIM.GRAD_CLIP, stages)
    else:
        norm = grad_norm(parts.opt_params, stages)
    parts.grad_norm = norm.detach()
    if parts.before_update is not None:
        parts.before_update()  # e.g. a checkpoint's copy of the weights must be done
    if parts.scaler.step(parts.optimizer, skip) and parts.master is not None:
        parts.master.master_to_model()  # unchanged masters after a skipped step
    parts.scaler.update(found_inf)
    if parts.after_update is not None:
        parts.after_update()  # e.g. AMP.FP8's float8 scales of the new weights
    parts.optimizer.zero_grad(set_to_none=True)
    return loss, logits, found_inf


def step_without_images(parts):
    """A training batch whose images all failed to decode (the loader yields it empty
    to keep ranks in step). One process skips the step. Under several processes this
    rank joins the others' step with a blank image weighted zero, so that DDP's and
    FSDP's collectives line up and the replicas stay equal."""
    if distributed.world_size() == 1:
        return
    size = parts.train_loader.decoder.shape[0]  # this epoch's (size schedule)
    dtype = input_dtype(parts.mode, parts.half_dtype)
    # One image per micro-batch: as many forwards (FSDP's gathers) as the others;
    # a pipeline takes its fixed batch.
    n = parts.cfg.TRAIN.ACCUM_STEPS
    if parts.pipeline is not None:
        n = parts.cfg.TRAIN.BATCH_SIZE // parts.layout.dp
    blank = torch.zeros(n, 3, size, size, dtype=dtype, device=parts.device)
    label = torch.zeros(n, dtype=torch.long, device=parts.device)
    train_step(parts, blank, label, weight=0.0)


def spike_skipped(parts, epoch, it):
    """Whether the spike guard skipped this step (logged; its loss is kept out of
    the epoch's meter). False when the guard is off."""
    if parts.spike_guard is None:
        return False
    where = f"epoch {epoch + 1}, iteration {it + 1}"
    return parts.spike_guard.record(
        where, lambda: files.last_checkpoint(parts.cfg.OUT_DIR) or "none yet"
    )


def check_finite(parts, meter, epoch):
    """Raises NonFiniteLossError when `meter` has seen a non-finite loss since its
    reset (reads it from the device: at log steps, before checkpoints, at the end
    of the epoch). fp16 loss scaling handles overflow itself, by skipping steps."""
    if parts.scaler.enabled:
        return
    bad = meter.first_non_finite()
    if bad is None:
        return
    it, loss_value = bad
    last = files.last_checkpoint(parts.cfg.OUT_DIR) or "none yet"
    hint = "lower OPTIM.BASE_LR"
    if parts.half_dtype == torch.float16 and parts.mode is not AmpMode.FP32:
        hint += ", or use AMP.DTYPE bf16"
    raise NonFiniteLossError(
        f"loss is {loss_value} at epoch {epoch + 1}, iteration {it + 1}; last good "
        f"checkpoint: {last}; try: {hint}"
    )


def eval_forward(parts, model, inputs, size=None):
    """`model`'s (parts.model's or parts.ema's) logits of `inputs`, through its
    pipeline under PARALLEL.PP: then None on the ranks before the last stage, and
    the batch is padded to `size` images (default: its own)."""
    runner = parts.ema_pipeline if model is parts.ema else parts.pipeline
    if runner is None:
        return model(inputs)
    return runner.evaluate(inputs, size or len(inputs))


def planned_forwards(parts):
    """FSDP: the most test batches any rank plans to run (every rank must run as
    many forwards: each gathers the parameters with collectives). Agreed on before
    the first forward: a reduction after the loop would meet a longer rank's
    all-gather and hang. None without FSDP."""
    if not fsdp_enabled(parts.cfg):
        return None
    return int(distributed.all_reduce_max([float(len(parts.test_loader))])[0])


def pad_sharded_forwards(parts, model, done, most):
    """FSDP: test shards may differ by one batch (and a batch of only bad images is
    not yielded); a rank that ran `done` forwards of the `most` (planned_forwards)
    runs the rest on a blank image, whose output is dropped."""
    if most is None:
        return
    size = parts.cfg.TRAIN.IM_SIZE
    dtype = input_dtype(parts.mode, parts.half_dtype)
    blank = torch.zeros(1, 3, size, size, dtype=dtype, device=parts.device)
    size = parts.cfg.TEST.BATCH_SIZE // parts.layout.dp
    for _ in range(most - done):
        with parts.autocast():
            eval_forward(parts, model, blank, size)
