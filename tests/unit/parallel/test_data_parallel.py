"""parallel/data_parallel.py in one process: TRAIN.COMPILE compiles what it names
before FSDP or DDP wrap it, and `state_bytes` counts what this rank holds."""

import torch

from pycls_fast.components.optimizer import construct_optimizer, param_groups
from pycls_fast.components.precision import AmpMode
from pycls_fast.models import build_model
from pycls_fast.parallel.data_parallel import encoder_blocks, shard, state_bytes
from tests.helpers import tiny_cfg


def _compiled(module) -> bool:
    # Module.compile wraps the module's forward in place (torch keeps it here).
    return getattr(module, "_compiled_call_impl", None) is not None


def test_train_compile_compiles_the_blocks_or_the_model():
    for how, model_compiled, blocks_compiled in (
        ("off", False, False),
        ("block", False, True),
        ("model", True, False),
    ):
        cfg = tiny_cfg("TRAIN.COMPILE", how)
        model = shard(build_model(cfg), cfg, AmpMode.FP32, torch.bfloat16)
        assert _compiled(model) is model_compiled, how
        assert all(_compiled(b) is blocks_compiled for b in encoder_blocks(model)), how


def test_state_bytes_are_the_tensors_elements_times_their_size():
    cfg = tiny_cfg("OPTIM.OPTIMIZER", "adamw")
    model = build_model(cfg)
    optimizer = construct_optimizer(param_groups(model, cfg), cfg)
    numel = sum(p.numel() for p in model.parameters())
    before = state_bytes(model, optimizer)
    assert before == {"params": 4 * numel, "grads": 0, "optimizer": 0,
                      "total": 4 * numel}  # fmt: skip
    model(torch.randn(2, 3, cfg.TRAIN.IM_SIZE, cfg.TRAIN.IM_SIZE)).sum().backward()
    model.head.head_fc.weight.grad = None  # a parameter without a gradient
    optimizer.step()  # AdamW: two fp32 moments per parameter, scalar steps not counted
    head = model.head.head_fc.weight.numel()
    after = state_bytes(model, optimizer)
    assert after["params"] == 4 * numel
    assert after["grads"] == 4 * (numel - head)
    assert after["optimizer"] == 2 * 4 * (numel - head)
    assert after["total"] == after["params"] + after["grads"] + after["optimizer"]
    model.half()
    assert state_bytes(model, optimizer)["params"] == 2 * numel
