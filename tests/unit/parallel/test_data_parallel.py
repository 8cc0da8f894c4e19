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


def test_o2_under_fsdp_keeps_the_norms_in_fp32_and_the_rest_in_half():
    """AMP.LAYER_NORM_FP32 under O2 and FSDP: the norms are one FSDP unit of their
    own (not one each: a unit costs hooks and collectives every step) whose weights
    are gathered in fp32, the blocks' in half; in any other case the norms go with
    their block."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    from pycls_fast.launch.processes import init_single_process_group

    def forward_dtypes(mode, ln_fp32):
        cfg = tiny_cfg("FSDP.ENABLED", "True", "AMP.LAYER_NORM_FP32", str(ln_fp32))
        model = shard(build_model(cfg), cfg, mode, torch.bfloat16)
        seen = {}
        for m in model.modules():
            if isinstance(m, (torch.nn.LayerNorm, torch.nn.Linear)):
                # After FSDP's own pre-hook: the gathered weight the forward uses.
                kind = "norm" if isinstance(m, torch.nn.LayerNorm) else "linear"
                m.register_forward_pre_hook(
                    lambda m, _, k=kind: seen.setdefault(k, set()).add(m.weight.dtype)
                )
        # O2 autocasts too, so that fp32 norms meet half-precision linears.
        with torch.autocast("cpu", torch.bfloat16, enabled=mode is AmpMode.O2):
            model(torch.randn(2, 3, cfg.TRAIN.IM_SIZE, cfg.TRAIN.IM_SIZE))
        norms = [m for m in model.modules() if isinstance(m, torch.nn.LayerNorm)]
        units = {isinstance(m, FSDPModule) for m in norms}
        if units == {True}:
            # One unit for all of them, apart from every block's unit.
            states = {id(m._get_fsdp_state()) for m in norms}
            blocks = {id(b._get_fsdp_state()) for b in encoder_blocks(model)}
            assert len(norms) > 2 and len(states) == 1 and not states & blocks
        return seen["norm"], seen["linear"], units

    init_single_process_group(tiny_cfg())
    try:
        bf16, fp32 = {torch.bfloat16}, {torch.float32}
        assert forward_dtypes(AmpMode.O2, True) == (fp32, bf16, {True})
        assert forward_dtypes(AmpMode.O2, False) == (bf16, bf16, {False})
        assert forward_dtypes(AmpMode.FP32, True) == (fp32, fp32, {False})
    finally:
        dist.destroy_process_group()


def test_o2_under_ddp_averages_half_gradients_through_the_fp32_hook():
    """DDP under O2 reduces the half-precision gradients through the fp32 comm hook:
    in one process the average is the gradient itself, exactly (bf16 -> fp32 ->
    bf16 is exact), and it lands in the half-precision .grad."""
    import copy

    import torch.distributed as dist

    from pycls_fast.launch.processes import init_single_process_group
    from pycls_fast.parallel.data_parallel import wrap_ddp

    cfg = tiny_cfg()
    torch.manual_seed(0)
    model = build_model(cfg).to(torch.bfloat16)
    alone = copy.deepcopy(model)
    x = torch.randn(2, 3, cfg.TRAIN.IM_SIZE, cfg.TRAIN.IM_SIZE, dtype=torch.bfloat16)
    alone(x).float().square().mean().backward()
    init_single_process_group(cfg)
    try:
        ddp = wrap_ddp(model, AmpMode.O2, torch.device("cpu"))
        ddp(x).float().square().mean().backward()
    finally:
        dist.destroy_process_group()
    for (name, p), q in zip(model.named_parameters(), alone.parameters(), strict=True):
        assert p.grad.dtype == torch.bfloat16, name
        assert torch.equal(p.grad, q.grad), name
