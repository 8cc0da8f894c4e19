"""What a run adds to its records: the step's gradient norm before clipping (read only
at log lines), throughput, memory and the loss scale."""

import pytest
import torch

from pycls_fast.engine.run_metrics import RunMetrics
from pycls_fast.engine.timing import synthetic_batch
from pycls_fast.engine.trainer import (
    build_components,
    forward_backward,
    seed_everything,
    train_step,
)
from tests.helpers import EXACT, float64_default, tiny_cfg


def test_grad_norm_is_the_norm_before_clipping(tmp_path):
    cfg = tiny_cfg("OUT_DIR", str(tmp_path), "OPTIM.GRAD_CLIP", "1e-3",
                   "TRAIN.BATCH_SIZE", "8")  # fmt: skip
    seed_everything(0)
    with float64_default():  # float64: the norm agrees with the reference at EXACT
        parts = build_components(cfg, loaders=())
        inputs, targets = synthetic_batch(parts, 8, 32)
    inputs = inputs.double()
    forward_backward(parts, inputs, targets)
    grads = [p.grad.double() for p in parts.opt_params if p.grad is not None]
    expected = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))
    parts.optimizer.zero_grad(set_to_none=True)
    train_step(parts, inputs, targets)
    assert expected > 1e-3  # so clipping changed the gradients
    assert parts.grad_norm.dtype == torch.float64
    assert parts.grad_norm.item() == pytest.approx(expected.item(), rel=EXACT["rtol"])

    metrics = RunMetrics(
        tiny_cfg("OUT_DIR", str(tmp_path), "MFU.PEAK_TFLOPS", "0.001"), parts, 10, True
    )
    fields = metrics.step_fields(parts, img_per_s=100.0)
    assert fields["grad_norm"] == parts.grad_norm.item()  # the step's, unrounded
    assert fields["loss_scale"] == 1.0 and fields["host_rss_mb"] > 0
    assert fields["mfu"] == pytest.approx(fields["tflops"] / 0.001)
