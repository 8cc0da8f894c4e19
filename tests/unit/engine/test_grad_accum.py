"""TRAIN.ACCUM_STEPS: a step in micro-batches is the step of the whole batch."""

import pytest
import torch

from pycls_fast.engine import timing
from pycls_fast.engine.trainer import build_components, seed_everything, train_step
from pycls_fast.errors import ConfigError
from tests.helpers import EXACT, float64_default, tiny_cfg


def _steps(*opts, steps=3, soft=False):
    """`steps` steps on one batch: (losses, last logits, weights). Without AMP in
    float64, where micro-batches and the whole batch agree to within EXACT."""
    if "AMP.MODE" in opts:
        return _run_steps(*opts, steps=steps, soft=soft)
    with float64_default():
        return _run_steps(*opts, steps=steps, soft=soft)


def _run_steps(*opts, steps, soft):
    # SGD: the update is linear in the gradient, so the weights compare as closely
    # as the gradients (Adam's normalization blows up differences of ~0 gradients).
    cfg = tiny_cfg(
        "TRAIN.BATCH_SIZE", "16", "OPTIM.OPTIMIZER", "sgd", "OPTIM.BASE_LR", "0.5",
        "OPTIM.MOMENTUM", "0.9", "OPTIM.GRAD_CLIP", "1.0", *opts,
    )  # fmt: skip
    seed_everything(0)
    parts = build_components(cfg, loaders=False)
    inputs, targets = timing.synthetic_batch(parts, 16, cfg.TRAIN.IM_SIZE)
    if "AMP.MODE" not in opts:
        inputs = inputs.double()
    if soft:  # mixup-like soft targets
        g = torch.Generator().manual_seed(2)
        targets = torch.softmax(torch.randn(16, 10, generator=g), 1)
    losses, logits = [], None
    for _ in range(steps):
        loss, logits, _ = train_step(parts, inputs, targets)
        losses.append(loss.item())
    return losses, logits, parts.model.state_dict()


@pytest.mark.parametrize("soft", [False, True])
@pytest.mark.parametrize("loss", ["ce", "bce"])
def test_micro_batches_give_the_whole_batch_step(soft, loss):
    whole, whole_logits, whole_state = _steps("TRAIN.LOSS", loss, soft=soft)
    for accum in ("2", "4"):
        losses, logits, state = _steps(
            "TRAIN.LOSS", loss, "TRAIN.ACCUM_STEPS", accum, soft=soft
        )
        # The same loss and logits of the batch, the same weights after the steps,
        # up to the order of float64 sums.
        assert logits.dtype == torch.float64
        torch.testing.assert_close(losses, whole, **EXACT)
        torch.testing.assert_close(logits, whole_logits, **EXACT)
        for key, value in state.items():
            torch.testing.assert_close(value, whole_state[key], **EXACT)


def test_micro_batches_under_fsdp_give_the_whole_batch_step():
    """FSDP2 in one process: the gradient reduction is off for all micro-batches
    but the last, which reduces their sum; the step is the whole batch's."""
    import torch.distributed as dist

    from pycls_fast.launch.processes import init_single_process_group

    init_single_process_group(tiny_cfg())
    try:
        whole = _steps("FSDP.ENABLED", "True")
        micro = _steps("FSDP.ENABLED", "True", "TRAIN.ACCUM_STEPS", "2")
    finally:
        dist.destroy_process_group()
    torch.testing.assert_close(micro[0], whole[0], **EXACT)
    for key, value in micro[2].items():
        assert value.dtype == torch.float64
        torch.testing.assert_close(
            value.full_tensor(), whole[2][key].full_tensor(), **EXACT
        )


def test_micro_batches_under_fp16_loss_scaling_match():
    # fp16 matmuls sum the batch's gradients in another order: the micro-batches
    # round elsewhere, but no more than fp16 itself does. Both runs against the exact
    # (float64) steps: accumulating adds at most the whole batch's own fp16 error
    # again (|accum - exact| <= |accum - whole| + |whole - exact|, each a rounding of
    # the same size); a wrong scale or a lost micro-batch is far beyond it.
    fp16 = ["AMP.MODE", "O1", "AMP.DTYPE", "fp16"]
    exact_losses, _, exact = _steps()
    whole, _, whole_state = _steps(*fp16)
    losses, _, state = _steps(*fp16, "TRAIN.ACCUM_STEPS", "2")

    def error(got, want):
        return max(float((got[k].double() - v).abs().max()) for k, v in want.items())

    assert error(state, exact) <= 2 * error(whole_state, exact)
    loss_error = max(abs(a - b) for a, b in zip(whole, exact_losses))
    assert max(abs(a - b) for a, b in zip(losses, exact_losses)) <= 2 * loss_error


def _float64_steps(n, accum):
    """3 SGD steps on a batch of `n` images in `accum` micro-batches, in float64:
    (losses, weights)."""
    torch.set_default_dtype(torch.float64)
    try:
        cfg = tiny_cfg(
            "TRAIN.BATCH_SIZE", "16", "TRAIN.ACCUM_STEPS", str(accum),
            "OPTIM.OPTIMIZER", "sgd", "OPTIM.BASE_LR", "0.5", "OPTIM.MOMENTUM", "0.9",
        )  # fmt: skip
        seed_everything(0)
        parts = build_components(cfg, loaders=False)
        inputs, targets = timing.synthetic_batch(parts, n, cfg.TRAIN.IM_SIZE)
        losses = [
            train_step(parts, inputs.double(), targets)[0].item() for _ in range(3)
        ]
        return losses, parts.model.state_dict()
    finally:
        torch.set_default_dtype(torch.float32)


def test_an_uneven_batch_weighs_each_image_alike():
    """13 images (a batch of 16 that lost 3 bad images) in micro-batches of 4, 4, 4
    and 1: each image's loss weighs 1/13, as in one step of the whole batch. In
    float64 the two differ only in the order of sums (~1e-16 relative per sum,
    far below sqrt(eps) ~ 1.5e-8); weighting the micro-batches alike moves the
    single image's weight from 1/13 to 1/4."""
    whole, whole_state = _float64_steps(13, 1)
    losses, state = _float64_steps(13, 4)
    exact = {"rtol": torch.finfo(torch.float64).eps ** 0.5, "atol": 1e-12}
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(whole), **exact)
    for key, value in state.items():
        assert value.dtype == torch.float64
        torch.testing.assert_close(value, whole_state[key], **exact)


def test_accum_steps_must_divide_each_process_batch():
    with pytest.raises(ConfigError, match="TRAIN.ACCUM_STEPS \\(3\\) must divide"):
        tiny_cfg("TRAIN.BATCH_SIZE", "16", "TRAIN.ACCUM_STEPS", "3")
