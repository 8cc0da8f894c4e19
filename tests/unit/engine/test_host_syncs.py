"""No host sync on a training step without a log line; an EMA kept in fp32.

A host sync is any read of a tensor's value on the host (`.item()`, `.tolist()`,
`bool(t)`, `float(t)`, `.cpu()`, `.numpy()`) or `torch.cuda.synchronize()`; on a GPU
each one waits for the device to finish all queued work. On this CPU-only machine
such a call is cheap, so the test counts the calls themselves: those made by the
package's code (torch's own Python code is read separately: docs/PERFORMANCE.md) on
the main thread (the loader's threads work on host tensors).
"""

import os
import sys
import threading

import pytest
import torch

from pycls_fast.components.ema import update_ema
from pycls_fast.engine import trainer
from pycls_fast.engine.trainer import build_components, train_epoch
from tests.helpers import digits_cfg, rounding_tolerance, tiny_cfg, vit_roundings

PACKAGE = os.path.dirname(sys.modules["pycls_fast"].__file__) + os.sep
READS = ("item", "tolist", "__bool__", "__float__", "__int__", "cpu", "numpy")


class SyncCounter:
    """Counts host reads of tensors made from the package's code."""

    def __init__(self, monkeypatch):
        self.count = 0
        for name in READS:
            monkeypatch.setattr(
                torch.Tensor, name, self._wrap(getattr(torch.Tensor, name))
            )
        monkeypatch.setattr(
            torch.cuda, "synchronize", self._wrap(torch.cuda.synchronize)
        )

    def _wrap(self, fn):
        def counted(*args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if (
                caller.startswith(PACKAGE)
                and threading.current_thread() is threading.main_thread()
            ):
                self.count += 1
            return fn(*args, **kwargs)

        return counted

    def take(self) -> int:
        count, self.count = self.count, 0
        return count


class CountPerStep:
    """Wraps the train batches: the syncs between handing out batch k and batch
    k + 1 are step k's (its forward, backward, update, EMA, log line if due)."""

    def __init__(self, batches, counter):
        self.batches, self.counter, self.per_step = batches, counter, []

    def __getattr__(self, name):
        return getattr(self.batches, name)

    def __len__(self):
        return len(self.batches)

    def __iter__(self):
        first = True
        for batch in self.batches:
            taken = self.counter.take()
            if not first:
                self.per_step.append(taken)
            first = False
            yield batch
        self.per_step.append(self.counter.take())


def _cfg(digits, out_dir, *opts):
    return digits_cfg(
        digits, out_dir,
        "TRAIN.BATCH_SIZE", "64", "OPTIM.MAX_EPOCH", "1",
        "OPTIM.WARMUP_EPOCHS", "0", "OPTIM.BASE_LR", "0.001",
        "LOG_PERIOD", "4", "DATA_LOADER.NUM_WORKERS", "2",
        "OPTIM.GRAD_CLIP", "1.0", "OPTIM.EMA_ALPHA", "1e-4",
        "OPTIM.EMA_UPDATE_PERIOD", "1", "OPTIM.OPTIMIZER", "adamw",
        "OPTIM.MTA", "True", "TRAIN.MIXUP_ALPHA", "0.8",
        *opts,
    )  # fmt: skip


@pytest.mark.parametrize(
    "mode,dtype",
    [("fp32", "bf16"), ("O1", "bf16"), ("O2", "bf16"), ("O3", "bf16"), ("O1", "fp16")],
)
def test_no_host_sync_on_steps_without_a_log_line(
    digits, tmp_path, monkeypatch, mode, dtype
):
    cfg = _cfg(digits, tmp_path, "AMP.MODE", mode, "AMP.DTYPE", dtype)
    parts = build_components(cfg, loaders=("train",))
    counter = SyncCounter(monkeypatch)
    parts.train_batches = CountPerStep(parts.train_batches, counter)
    train_epoch(parts, 0)
    steps = parts.train_batches.per_step
    assert len(steps) == len(parts.train_loader) >= 2 * cfg.LOG_PERIOD
    logging = [i for i in range(len(steps)) if (i + 1) % cfg.LOG_PERIOD == 0]
    # fp16: the loss scaler reads the overflow flag until the optimizer's first clean
    # step (a fused optimizer must not skip the step that creates its state): those
    # steps, at most the skipped ones and the first clean one, may sync.
    first = parts.scaler.skipped_steps + 1 if dtype == "fp16" else 0
    assert [
        i for i, n in enumerate(steps) if n and i not in logging and i >= first
    ] == [], steps
    # The counter sees the reads a log line makes.
    assert all(steps[i] > 0 for i in logging), steps


def _ema_vs_fp32_reference(parts, alpha, updates=100):
    """Moves the model `updates` times, updating the EMA and an fp32 reference EMA of
    the same weights; returns (ema state, reference)."""
    torch.manual_seed(0)
    reference = {
        k: v.detach().float().clone() for k, v in parts.ema.state_dict().items()
    }
    for _ in range(updates):
        with torch.no_grad():
            for p in parts.model.parameters():
                p.add_(torch.randn_like(p), alpha=1e-3)
        update_ema(parts.model, parts.ema, alpha)
        for k, v in parts.model.state_dict().items():
            if v.is_floating_point():
                reference[k].lerp_(v.float(), alpha)
    return parts.ema.state_dict(), reference


def _assert_follows(value, reference, updates=100):
    """`value` is `reference`'s EMA computed by another fp32 lerp kernel: each update
    rounds a difference, a product and a sum (<= 3 u, u = eps / 2, of the operands'
    magnitude, bounded by the largest entry) on each side; (1 - alpha) < 1 damps the
    earlier updates' errors, so `updates` of them add at most updates x 3 eps."""
    bound = updates * 3 * torch.finfo(torch.float32).eps * reference.abs().max()
    torch.testing.assert_close(value, reference, rtol=0, atol=bound.item())


@pytest.mark.parametrize("mode", ["O2", "O3"])
def test_the_ema_is_fp32_and_follows_an_fp32_reference(mode):
    cfg = tiny_cfg("AMP.MODE", mode, "OPTIM.EMA_ALPHA", "1e-4")
    parts = build_components(cfg, loaders=False)
    assert {p.dtype for p in parts.model.parameters()} >= {torch.bfloat16}
    floats = [t for t in parts.ema.state_dict().values() if t.is_floating_point()]
    assert {t.dtype for t in floats} == {torch.float32}
    start = {k: v.clone() for k, v in parts.ema.state_dict().items()}
    ema, reference = _ema_vs_fp32_reference(parts, alpha=3e-3)
    moved = changed = 0
    for key, value in ema.items():
        if value.is_floating_point():
            # The model's weights are bf16: the reference is the fp32 EMA of them.
            _assert_follows(value, reference[key])
            moved += (value != start[key]).sum().item()
            changed += value.numel()
    assert moved / changed > 0.5


def test_a_half_precision_ema_would_fail_that_test():
    """What the fp32 EMA fixes: the same updates to a bf16 copy round away."""
    parts = build_components(tiny_cfg("AMP.MODE", "O3"), loaders=False)
    parts.ema = parts.ema.to(torch.bfloat16)  # the EMA as it was: the model's dtype
    start = {k: v.clone() for k, v in parts.ema.state_dict().items()}
    ema, reference = _ema_vs_fp32_reference(parts, alpha=3e-3)
    with pytest.raises(AssertionError):
        for key, value in ema.items():
            _assert_follows(value.float(), reference[key])
    moved = sum((ema[k] != start[k]).sum().item() for k in ema)
    total = sum(v.numel() for v in ema.values())
    assert moved / total < 0.5


def test_an_fp32_ema_evaluates_under_o3(digits, tmp_path):
    cfg = _cfg(digits, tmp_path, "AMP.MODE", "O3", "TEST.BATCH_SIZE", "200")
    parts = build_components(cfg, loaders=("test",))
    # A drawn head (pycls zeroes it: every loss would be log(10) in any precision),
    # the same in the bf16 model and its fp32 EMA.
    torch.manual_seed(0)
    with torch.no_grad():
        pairs = zip(parts.model.named_parameters(), parts.ema.parameters())
        for (name, weight), ema_weight in pairs:
            if name.startswith("head"):
                weight.normal_(std=0.5)
                ema_weight.copy_(weight.float())
    record = trainer.test_epoch(parts, parts.ema, 0, "test_ema_epoch")
    model = trainer.test_epoch(parts, parts.model, 0)
    assert record["images"] == model["images"] > 0
    # Same weights (the EMA is the model's copy before training), other precision:
    # both round the matmul outputs to bf16 (vit_roundings); O3 also rounds, per
    # block, the 2 LayerNorm outputs, the softmax, the GELU, the 2 residual sums and
    # the scaled queries (7) where autocast keeps fp32, each to either neighbour (2).
    layers = cfg.VIT.NUM_LAYERS
    roundings = vit_roundings(layers) + layers * 7 * 2
    rel = rounding_tolerance(torch.bfloat16, roundings)
    assert record["loss"] == pytest.approx(model["loss"], rel=rel)
    assert record["loss"] != model["loss"]  # the EMA did not run in bf16
