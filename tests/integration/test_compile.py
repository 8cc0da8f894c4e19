"""TRAIN.COMPILE: the compiled model trains as the eager one does (a few steps of the
tiny ViT, per block and whole, with FSDP2 and activation checkpointing)."""

import pytest
import torch

from pycls_fast.engine import timing
from pycls_fast.engine.trainer import build_components, seed_everything, train_step
from pycls_fast.launch import processes as launch
from pycls_fast.parallel.data_parallel import encoder_blocks
from tests.helpers import EXACT, float64_default, tiny_cfg


def _losses(cfg, steps=3):
    """float64: compiled and eager are the same math in another kernel order, so
    they agree at EXACT on any CPU."""
    seed_everything(0)
    with float64_default():
        parts = build_components(cfg, loaders=False)
        inputs, targets = timing.synthetic_batch(parts, 8, cfg.TRAIN.IM_SIZE)
        inputs = inputs.double()
        losses = [train_step(parts, inputs, targets)[0].item() for _ in range(steps)]
    compiled = [b._compiled_call_impl is not None for b in encoder_blocks(parts.model)]
    return losses, compiled, parts.model._compiled_call_impl is not None


def _cfg(*opts):
    return tiny_cfg(
        "TRAIN.BATCH_SIZE", "8", "OPTIM.OPTIMIZER", "adamw", "OPTIM.BASE_LR", "1e-3",
        *opts,
    )  # fmt: skip


def test_compiled_training_matches_eager():
    eager, blocks, whole = _losses(_cfg())
    assert not any(blocks) and not whole
    per_block, blocks, whole = _losses(_cfg("TRAIN.COMPILE", "block"))
    assert all(blocks) and not whole
    model, blocks, whole = _losses(_cfg("TRAIN.COMPILE", "model"))
    assert whole and not any(blocks)
    assert per_block == pytest.approx(eager, rel=EXACT["rtol"], abs=EXACT["atol"])
    assert model == pytest.approx(eager, rel=EXACT["rtol"], abs=EXACT["atol"])


def test_compiled_blocks_compose_with_fsdp_and_activation_checkpointing():
    fsdp = [
        "NUM_GPUS",
        "1",
        "FSDP.ENABLED",
        "True",
        "FSDP.ACTIVATION_CHECKPOINT",
        "True",
    ]
    eager = launch.launch(lambda cfg: _losses(cfg)[0], _cfg(*fsdp))
    compiled = launch.launch(
        lambda cfg: _losses(cfg)[0], _cfg(*fsdp, "TRAIN.COMPILE", "block")
    )
    assert torch.tensor(compiled).isfinite().all()
    assert compiled == pytest.approx(eager, rel=EXACT["rtol"], abs=EXACT["atol"])


def test_cuda_graphs_compile_the_whole_model_and_train_as_eager(monkeypatch):
    # On a CPU, 'reduce-overhead' compiles without graphs: the math must be eager's.
    modes, marks = [], []
    real = torch.nn.Module.compile

    def compile_(module, **kwargs):
        modes.append(kwargs.get("mode"))
        return real(module, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "compile", compile_)
    monkeypatch.setattr(
        torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1)
    )
    graphs, blocks, whole = _losses(_cfg("TRAIN.CUDA_GRAPHS", "True"), steps=3)
    assert whole and not any(blocks) and modes == ["reduce-overhead"]
    assert len(marks) == 3  # a new step of replays begins before each step
    eager, _, _ = _losses(_cfg(), steps=3)
    assert graphs == pytest.approx(eager, rel=EXACT["rtol"], abs=EXACT["atol"])
