"""parallel/pipeline.py on its own, without the trainer: split_model, stage_union and
PipelineRunner with a plain torch optimizer on 2 gloo processes train (10 steps on a
fixed batch) and then evaluate (a partial batch, padded) as the whole model does in
one process, under each schedule, both token layouts and bf16 autocast.
(tests/integration/test_pipeline_parallel.py runs the trainer's PP path.)

One spawn runs every case, each rank writing its results to a file."""

import contextlib
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from pycls_fast.config import load_cfg, with_overrides
from pycls_fast.launch import processes as launch
from pycls_fast.models import build_model
from pycls_fast.parallel.pipeline import PipelineRunner, split_model, stage_union
from tests.helpers import (
    EXACT,
    TINY,
    amp_loss_tolerance,
    float64_default,
    rounding_tolerance,
    vit_roundings,
)

STEPS = 10
BASE = [
    *TINY, "VIT.HIDDEN_DIM", "32", "VIT.NUM_HEADS", "2", "VIT.MLP_DIM", "64",
    "VIT.NUM_LAYERS", "4", "TRAIN.BATCH_SIZE", "8", "TEST.BATCH_SIZE", "8",
]  # fmt: skip
PP2 = ["NUM_GPUS", "2", "PARALLEL.PP", "2"]
# name: (config overrides, optimizer, bf16 autocast)
CASES = {
    "gpipe": ({"PARALLEL.PP_SCHEDULE": "gpipe"}, "sgd", False),
    "1f1b": ({"PARALLEL.PP_SCHEDULE": "1f1b"}, "sgd", False),
    # 4 layers in 4 stages: rank 0 holds blocks 0 and 2 (stages 0, 2), rank 1 1 and 3.
    "interleaved": ({"PARALLEL.PP_SCHEDULE": "interleaved"}, "sgd", False),
    # Micro-batches of one image: the activations sent are (1, seq, hidden).
    "1f1b_batch_first_token": (
        {
            "PARALLEL.PP_SCHEDULE": "1f1b",
            "VIT.LAYOUT": "batch_first",
            "VIT.CLASSIFIER_TYPE": "token",
            "PARALLEL.PP_MICROBATCHES": 8,
        },
        "sgd",
        False,
    ),  # fmt: skip
    "interleaved_bf16": ({"PARALLEL.PP_SCHEDULE": "interleaved"}, "adamw", True),
}
EVAL_N, EVAL_SIZE = 5, 6  # 5 images of a batch of 6, padded to 8 (4 micro-batches)


def _model(cfg):
    """The whole model, the same on every rank (seeded); the head drawn at random
    (pycls zeroes it, which would leave the blocks' first gradients zero)."""
    torch.manual_seed(0)
    model = build_model(cfg)
    torch.nn.init.normal_(model.head.head_fc.weight, std=0.1)
    return model


def _batch():
    g = torch.Generator().manual_seed(1)
    inputs = torch.randn(8, 3, 32, 32, generator=g)
    return inputs, torch.randint(0, 10, (8,), generator=g)


def _optimizer(name, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-3)


def _autocast(bf16):
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)


def _loss(logits, targets):
    if logits.dtype == torch.bfloat16:
        logits = logits.float()
    return F.cross_entropy(logits, targets)


def _precision(bf16):
    """bf16 autocast's cases run in fp32; the others in float64 (see EXACT)."""
    return contextlib.nullcontext() if bf16 else float64_default()


def _pipeline_cases(cfg):
    """Every case on this rank: {name: {losses, state, eval}}, saved to a file."""
    rank, out = dist.get_rank(), {}
    for name, (overrides, opt, bf16) in CASES.items():
        with _precision(bf16):
            out[name] = _pipeline_case(with_overrides(cfg, overrides), opt, bf16, rank)
    path = os.path.join(cfg.OUT_DIR, f"rank{rank}.pt")
    torch.save(out, path)
    return path


def _pipeline_case(case, opt, bf16, rank):
    """One case on this rank: {losses, state, eval}."""
    stages = split_model(_model(case), case, rank)
    runner = PipelineRunner(stages, case, dist.group.WORLD, torch.device("cpu"))
    union = stage_union([m for _, m in stages])
    optimizer = _optimizer(opt, union.parameters())
    inputs, targets = _batch()
    losses = []
    for _ in range(STEPS):
        with _autocast(bf16):
            loss, logits = runner.train(inputs, targets, _loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if loss is not None:
            assert logits.shape == (8, 10)
            losses.append(float(loss))
    for module in runner.modules:
        module.eval()
    with _autocast(bf16):
        logits = runner.evaluate(inputs[:EVAL_N], EVAL_SIZE)
    return {"losses": losses, "state": union.state_dict(), "eval": logits}


def _one_process(name):
    """The whole model trained and evaluated as the case does, in this process."""
    overrides, opt, bf16 = CASES[name]
    with _precision(bf16):
        return _one_process_case(
            with_overrides(load_cfg(None, BASE), overrides), opt, bf16
        )


def _one_process_case(cfg, opt, bf16):
    model = _model(cfg)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = _optimizer(opt, model.parameters())
    inputs, targets = _batch()
    losses = []
    for _ in range(STEPS):
        with _autocast(bf16):
            loss = _loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    model.eval()
    with torch.no_grad(), _autocast(bf16):
        logits = model(inputs[:EVAL_N])
    return {"losses": losses, "state": model.state_dict(), "eval": logits, "init": init}


def _evaluate(name, state):
    """The case's one-process evaluation of the weights `state`."""
    overrides, _, bf16 = CASES[name]
    model = _model(with_overrides(load_cfg(None, BASE), overrides))
    model.load_state_dict(state)
    model.eval()
    with torch.no_grad(), _autocast(bf16):
        return model(_batch()[0][:EVAL_N])


def _update_error(got, want, init):
    """|got - want| / |want - init| over all weights: how far the pipeline's
    training moved the weights from where one process's moved them, relatively."""
    diff = sum(((got[k] - v) ** 2).sum() for k, v in want.items())
    step = sum(((v - init[k]) ** 2).sum() for k, v in want.items())
    return float((diff / step).sqrt())


@pytest.fixture(scope="module")
def pipelined(tmp_path_factory):
    out = tmp_path_factory.mktemp("pipeline")
    cfg = load_cfg(None, [*BASE, *PP2, "OUT_DIR", str(out)])
    launch.launch(_pipeline_cases, cfg)
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


@pytest.mark.parametrize("name", list(CASES))
def test_runner_trains_and_evaluates_as_one_process(pipelined, name):
    want = _one_process(name)
    first, last = pipelined[0][name], pipelined[1][name]
    # Rank 1 holds the last stage (stage 1, or 3 interleaved): losses and logits.
    assert first["losses"] == [] and first["eval"] is None
    assert len(last["losses"]) == STEPS
    # The ranks' stages hold disjoint parameters, together the whole model's names.
    assert not first["state"].keys() & last["state"].keys()
    state = {**first["state"], **last["state"]}
    assert state.keys() == want["state"].keys()
    assert last["eval"].shape == (EVAL_N, 10)
    assert want["losses"][-1] < want["losses"][0]
    if CASES[name][2]:
        # bf16: micro-batches round their matmul outputs and weight gradients apart
        # from one process's whole batch. The losses stay within the bound those
        # roundings give (amp_loss_tolerance, as test_pipeline_parallel); the
        # evaluation, judged at the pipeline's own weights, within the forward's
        # roundings of the largest logit; AdamW's update is scale-free, so its
        # direction errs by the gradients' relative error: the forward's roundings
        # plus one rounding of each side's weight gradient (eps).
        roundings = vit_roundings(4)
        bound = amp_loss_tolerance(want["losses"], roundings)
        torch.testing.assert_close(last["losses"], want["losses"], rtol=0, atol=bound)
        at_its_weights = _evaluate(name, state)
        forward = rounding_tolerance(torch.bfloat16, roundings)
        atol = forward * float(at_its_weights.float().abs().max())
        torch.testing.assert_close(
            last["eval"].float(), at_its_weights.float(), rtol=0, atol=atol
        )
        step_bound = forward + torch.finfo(torch.bfloat16).eps
        assert _update_error(state, want["state"], want["init"]) < step_bound
        return
    # Without autocast: the same sums in another order (micro-batches), computed in
    # float64: equal to within EXACT.
    assert last["eval"].dtype == torch.float64
    torch.testing.assert_close(last["losses"], want["losses"], **EXACT)
    torch.testing.assert_close(last["eval"], want["eval"], **EXACT)
    for key, value in want["state"].items():
        torch.testing.assert_close(state[key], value, **EXACT)
