"""The planner's choices: the fastest layout that fits, FSDP's and TP's shares,
pipeline stages, activation checkpointing's savings, none when nothing fits, and
PARALLEL.AUTO's config."""

import pytest
import torch

from pycls_fast.config import load_cfg, with_overrides
from pycls_fast.errors import UserError
from pycls_fast.models import build_model
from pycls_fast.parallel.data_parallel import encoder_blocks
from pycls_fast.parallel.pipeline import split_model
from pycls_fast.parallel.planner import (
    GIB,
    HALF_TOKENS,
    Candidate,
    activation_bytes,
    auto_layout,
    candidates,
    fit_in_one_process,
    interleaved_in_flight,
    per_rank_memory,
    plan,
    predicted_speed,
    rank_memory,
)
from tests.helpers import tiny_cfg


def test_fsdp_shards_the_state_and_checkpointing_the_activations():
    cfg = tiny_cfg("TRAIN.BATCH_SIZE", "64", "OPTIM.OPTIMIZER", "adamw")
    ddp = per_rank_memory(cfg, Candidate(dp=4))
    fsdp = per_rank_memory(cfg, Candidate(dp=4, fsdp=True))
    ac = per_rank_memory(cfg, Candidate(dp=4, fsdp=True, checkpoint=True))
    assert ddp["optimizer"] == 2 * ddp["params"]  # Adam: two fp32 moments
    assert fsdp["params"] < 0.3 * ddp["params"]  # about a quarter, chunks rounded up
    assert fsdp["gathered"] > 0 and ddp["gathered"] == 0
    assert ac["activations"] < fsdp["activations"]
    assert ddp["activations"] == fsdp["activations"]
    half = per_rank_memory(cfg, Candidate(dp=8))["activations"]
    assert half * 2 == ddp["activations"]


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_each_pipeline_rank_counts_the_parameters_its_stages_hold(schedule):
    """fp32 weights, no FSDP: a pipeline rank's planned weights are 4 bytes for each
    parameter of the stages split_model gives it (the stem and positions on the
    first stage, the final norm and the head on the last)."""
    cfg = tiny_cfg(
        "TRAIN.BATCH_SIZE", "64", "VIT.NUM_LAYERS", "4", "AMP.MODE", "fp32",
        "NUM_GPUS", "2", "PARALLEL.PP", "2", "PARALLEL.PP_SCHEDULE", schedule,
        "PARALLEL.PP_MICROBATCHES", "4", "MODEL.NUM_CLASSES", "1000",
    )  # fmt: skip
    c = Candidate(pp=2, micro=4)
    for rank in range(2):
        numel = sum(_numel(m) for m in _rank_stages(cfg, 2, rank))
        assert rank_memory(cfg, c, rank)["params"] == 4 * numel


def test_tensor_and_pipeline_parallelism_split_the_blocks():
    cfg = tiny_cfg("TRAIN.BATCH_SIZE", "64", "VIT.NUM_LAYERS", "4")
    one = per_rank_memory(cfg, Candidate())
    tp = per_rank_memory(cfg, Candidate(tp=2))
    pp = per_rank_memory(cfg, Candidate(pp=2, micro=4))
    # TP halves the four block matmuls (most of a block), not the rest.
    assert 0.5 * one["params"] < tp["params"] < 0.75 * one["params"]
    assert tp["activations"] < one["activations"]
    # PP: the heavier stage holds about half the blocks, and the stem or the head.
    assert 0.4 * one["params"] < pp["params"] < 0.75 * one["params"]

    # The bubble: 2 stages, 4 micro-batches -> 4 / 5; interleaved -> 4 / 4.5; and
    # micro-batches a quarter of the batch run smaller matmuls.
    def matmul(images):
        tokens = images * 17  # 32 px, 8 px patches, and the class token
        return tokens / (tokens + HALF_TOKENS)

    pp = per_rank_memory(cfg, Candidate(pp=2, micro=4))
    assert predicted_speed(cfg, Candidate(pp=2, micro=4)) == pytest.approx(
        0.8 * matmul(16)
    )
    cfg_i = tiny_cfg("TRAIN.BATCH_SIZE", "64", "PARALLEL.PP_SCHEDULE", "interleaved",
                     "VIT.NUM_LAYERS", "4")  # fmt: skip
    assert predicted_speed(cfg_i, Candidate(pp=2, micro=4)) == pytest.approx(
        4 / 4.5 * matmul(16)
    )
    assert predicted_speed(cfg, Candidate()) == pytest.approx(matmul(64))
    assert predicted_speed(cfg, Candidate(tp=2)) < predicted_speed(cfg, Candidate())
    # 1F1B keeps at most PP micro-batches in flight: more of them, less memory.
    more = per_rank_memory(cfg, Candidate(pp=2, micro=8))
    assert more["activations"] < pp["activations"]


@pytest.mark.parametrize("mode", ["O1", "O3"])
def test_fsdp_accumulation_keeps_the_whole_gradients_unsharded(mode):
    """FSDP2 with gradient sync off between micro-batches keeps each parameter's
    whole gradient (in the reduce dtype: fp32 under O1, bf16 under O3) until the
    last micro-batch: the rank's whole model, not 1/DP of it. DDP's gradients are
    whole anyway."""
    opts = ["TRAIN.BATCH_SIZE", "64", "AMP.MODE", mode, "TRAIN.MIXED_PRECISION",
            "False"]  # fmt: skip
    one, four = tiny_cfg(*opts), tiny_cfg(*opts, "TRAIN.ACCUM_STEPS", "4")
    numel = sum(p.numel() for p in build_model(one).parameters())
    grad_b = 4 if mode == "O1" else 2
    fsdp = Candidate(dp=8, fsdp=True)
    a, b = per_rank_memory(one, fsdp), per_rank_memory(four, fsdp)
    assert b["grads"] - a["grads"] == numel * grad_b
    assert b["activations"] * 4 == a["activations"]
    ddp = Candidate(dp=8)
    assert per_rank_memory(four, ddp)["grads"] == per_rank_memory(one, ddp)["grads"]


def _torch_interleaved_peak(pp: int, v: int, m: int, rank: int) -> float:
    """The most forward chunks pipeline rank `rank` holds un-backwarded in torch's
    own Interleaved1F1B order (its rank ops), in micro-batches through all of the
    rank's `v` stages."""
    from torch.distributed.pipelining import schedules as s

    rounds = max(1, m // pp)
    per_round = m // rounds
    warmup = s._get_warmup_ops(rank, v, per_round, pp, m, multiply_factor=2)
    steady = v * m - warmup

    def forward_stage(step):
        return ((step // per_round) % v) * pp + rank

    def backward_stage(step):
        return (v - 1 - ((step - warmup) // per_round) % v) * pp + rank

    ops = s._get_1f1b_rank_ops(
        v, pp, warmup, steady, v * m - steady, rank, forward_stage, backward_stage
    )
    live = peak = 0
    for op in filter(None, ops):
        name = op.computation_type.name
        live += 1 if name == "FORWARD" else -1 if "BACKWARD" in name else 0
        peak = max(peak, live)
    return peak / v


@pytest.mark.parametrize("pp", [2, 4])
def test_interleaved_in_flight_is_what_torchs_schedule_keeps(pp):
    """Every pipeline rank, not only the first: the later ranks' warm-up is shorter
    by 2 chunks a rank, not by a whole round (1.5 micro-batches on the last of 2
    ranks, not 1.25)."""
    for m in (pp, 2 * pp, 4 * pp):
        for rank in range(pp):
            want = _torch_interleaved_peak(pp, 2, m, rank)
            assert interleaved_in_flight(pp, 2, m, rank) == want, (m, rank)


def test_one_rank_folded_into_one_process_is_trimmed_to_what_fits():
    """tools/check_node.py times one rank of ViT-22B-14.yaml (TP 8 over 512 GPUs:
    16 images per rank) with TP and PP folded into one process: the whole model,
    ~87 GB of fp32 weights alone. On an 80 GiB GPU it is timed with the blocks
    that fit (and one more would not); a device too small for one block is
    refused in one line."""
    cfg = load_cfg(
        "configs/vit/ViT-22B-14.yaml",
        ["NUM_GPUS", "1", "PARALLEL.TP", "1", "TRAIN.BATCH_SIZE", "16"],
    )
    whole = per_rank_memory(cfg, Candidate(fsdp=True))
    assert whole["params"] > 80 * GIB
    fitted, layers = fit_in_one_process(cfg, 80)
    n = fitted.VIT.NUM_LAYERS
    assert layers == 48 and 1 <= n < 48
    assert per_rank_memory(fitted, Candidate(fsdp=True))["total"] <= 0.9 * 80 * GIB
    more = with_overrides(cfg, {"VIT.NUM_LAYERS": n + 1})
    assert per_rank_memory(more, Candidate(fsdp=True))["total"] > 0.9 * 80 * GIB
    small = tiny_cfg("TRAIN.BATCH_SIZE", "16")
    assert fit_in_one_process(small, 80) == (small, 2)  # fits: unchanged
    with pytest.raises(UserError, match="with a single block") as e:
        fit_in_one_process(cfg, 4)
    assert "\n" not in str(e.value)


def test_candidates_respect_what_the_config_checks():
    cfg = tiny_cfg("TRAIN.BATCH_SIZE", "64", "VIT.NUM_LAYERS", "4")
    layouts = candidates(cfg, 8)
    assert (
        Candidate(dp=8) in layouts
        and Candidate(pp=2, dp=2, tp=2, fsdp=True, micro=4) in layouts
    )
    for c in layouts:
        assert c.pp * c.dp * c.tp == 8 and c.pp <= 4
        assert cfg.VIT.NUM_HEADS % c.tp == 0
        assert c.fsdp or c.tp == 1 or c.dp == 1


def test_the_fastest_layout_that_fits_is_chosen():
    cfg = tiny_cfg("TRAIN.BATCH_SIZE", "64")
    rows = {r.layout.name: r for r in plan(cfg, 2, 80)[1]}
    assert plan(cfg, 2, 80)[0].layout == Candidate(dp=2)  # everything fits
    tight = (rows["fsdp2+ac"].memory["total"] + 1) / (0.9 * GIB)
    best, _ = plan(cfg, 2, tight)
    assert best.layout.checkpoint or best.layout.tp > 1 or best.layout.pp > 1
    assert best.memory["total"] <= 0.9 * tight * GIB
    smallest = min(r.memory["total"] for r in rows.values())
    best, _ = plan(cfg, 2, smallest / (0.9 * GIB) / 2)
    assert best is None


def test_auto_layout_writes_the_plan_into_the_config():
    cfg = tiny_cfg("TRAIN.BATCH_SIZE", "64", "NUM_GPUS", "2", "PARALLEL.AUTO", "True")
    planned, table = auto_layout(cfg, 80)
    assert (planned.PARALLEL.TP, planned.PARALLEL.PP) == (1, 1)
    assert not planned.FSDP.ENABLED and not planned.PARALLEL.AUTO
    assert "<- plan" in table
    rows = {r.layout.name: r for r in plan(cfg, 2, 80)[1]}
    tight = rows["fsdp1xtp2+ac"].memory["total"] / (0.9 * GIB) * 1.001
    planned, _ = auto_layout(cfg, tight)
    assert planned.PARALLEL.TP * planned.PARALLEL.PP > 1 or planned.FSDP.ENABLED
    with pytest.raises(UserError, match="PARALLEL.AUTO: no layout of 2 devices"):
        auto_layout(cfg, 1e-6)


def test_autograd_runs_a_cached_cast_last_holding_its_half_gradient():
    """What the planner assumes of a pipeline under O1 (its autocast context spans
    the step, the casts are cached from the first micro-batch): in a later
    micro-batch's backward every cast weight's bf16 gradient is alive at once,
    where a fresh autocast per micro-batch frees each one as it goes."""
    from pycls_fast.engine.dry_run import LiveBytes

    torch.manual_seed(0)
    layers, width = 8, 256
    net = torch.nn.Sequential(
        *[torch.nn.Linear(width, width, bias=False) for _ in range(layers)]
    )
    x = torch.randn(2, width)
    net(x).sum().backward()  # the fp32 .grad exist: later ones accumulate in place
    half_grad = width * width * 2  # one weight's bf16 gradient

    def backward_peak():
        """Bytes the backward adds (the casts were made before it, or cached)."""
        loss = net(x).float().sum()
        meter = LiveBytes()
        with meter:
            loss.backward()
        return meter.peak

    with torch.autocast("cpu", dtype=torch.bfloat16):
        fresh = backward_peak()  # casts made by this forward
    with torch.autocast("cpu", dtype=torch.bfloat16):
        net(x).float().sum().backward()  # the first micro-batch fills the cache
        cached = backward_peak()  # a later one: the casts are the cache's
    assert fresh < layers / 2 * half_grad  # a few gradients at a time
    assert cached >= layers * half_grad  # every gradient at once


def test_pipeline_with_autocast_cache_holds_the_casts_half_gradients():
    """O1 in a pipeline without FSDP (autocast's cache on): the casts, plus their
    half gradients beyond one micro-batch's activations (freed as they appear);
    under FSDP the cache is off and nothing piles up."""
    o1 = ("TRAIN.MIXED_PRECISION", "True", "AMP.MODE", "O1", "AMP.DTYPE", "bf16")
    cfg = tiny_cfg("TRAIN.BATCH_SIZE", "8", "VIT.NUM_LAYERS", "4", *o1)
    casts = 2 * _stage_matmul_numel(cfg, 2, 0)  # the first stage's, in bf16
    pp = per_rank_memory(cfg, Candidate(pp=2, checkpoint=True, micro=4))
    one_micro = pp["activations"] / 2  # 1F1B: 2 micro-batches in flight
    assert 0 < one_micro < casts
    assert pp["autocast"] == casts + int(casts - one_micro)


def _rank_stages(cfg, pp: int, rank: int) -> list:
    """The stage modules split_model gives pipeline rank `rank` of `pp` (meta)."""
    cfg = with_overrides(cfg, {"NUM_GPUS": pp, "PARALLEL.PP": pp})
    with torch.device("meta"):
        return [m for _, m in split_model(build_model(cfg), cfg, rank)]


def _numel(module) -> int:
    return sum(p.numel() for p in module.parameters())


def _stage_matmul_numel(cfg, pp: int, rank: int) -> int:
    """Elements of the Linear and Conv2d parameters (weights and biases: autocast
    casts both) of pipeline rank `rank`'s stages."""
    return sum(
        p.numel()
        for stage in _rank_stages(cfg, pp, rank)
        for m in stage.modules()
        if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))
        for p in m.parameters(recurse=False)
    )


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved"])
def test_fsdp_pipeline_casts_per_micro_batch_in_flight(schedule):
    """O1 under FSDP in a pipeline (autocast's cache off): every (micro-batch,
    stage) forward in flight keeps its own casts of the stage's weights for its
    backward; with checkpointing only the recomputed block's are live."""
    o1 = ("TRAIN.MIXED_PRECISION", "True", "AMP.MODE", "O1", "AMP.DTYPE", "bf16")
    cfg = tiny_cfg("TRAIN.BATCH_SIZE", "16", "VIT.NUM_LAYERS", "4",
                   "PARALLEL.PP_SCHEDULE", schedule, *o1)  # fmt: skip
    casts = 2 * _stage_matmul_numel(cfg, 2, 0)
    # Micro-batches (through all the rank's stages) in flight on the first rank
    # at its peak: all 4 under GPipe, PP - rank = 2 under 1F1B, torch's
    # interleaved warm-up (4 stage forwards) plus one: 5 of 2 stages.
    in_flight = {"gpipe": 4, "1f1b": 2, "interleaved": 2.5}[schedule]
    first = rank_memory(cfg, Candidate(pp=2, fsdp=True, micro=4), 0)
    assert first["autocast"] == int(casts * in_flight)
    checkpointed = rank_memory(cfg, Candidate(pp=2, fsdp=True, checkpoint=True,
                                              micro=4), 0)  # fmt: skip
    assert 0 < checkpointed["autocast"] < casts / 2  # one of the stage's blocks


@pytest.mark.parametrize("amp", ["fp32", "O1", "O2", "O3"])
def test_fsdp_pipeline_gathers_gradients_whole_and_weights_per_schedule(amp):
    """Under FSDP a pipeline rank keeps all its stages' gradients unsharded until
    its last backward, in the reduce dtype (fp32 but under O3); its weights are
    gathered block by block under GPipe and 1F1B (two blocks at a forward's end,
    the peak) and, interleaved, its other stage stays gathered from its backward."""
    cfg = tiny_cfg("TRAIN.BATCH_SIZE", "16", "VIT.NUM_LAYERS", "4",
                   "MODEL.NUM_CLASSES", "10", "FSDP.ENABLED", "True",
                   *_amp_keys(amp))  # fmt: skip
    compute_b = {"fp32": 4, "O1": 4, "O2": 2, "O3": 2}[amp]
    reduce_b = {"fp32": 4, "O1": 4, "O2": 4, "O3": 2}[amp]
    block = sum(p.numel() for p in encoder_blocks(build_model(cfg))[0].parameters())
    for schedule in ("1f1b", "interleaved"):
        cfg_s = with_overrides(cfg, {"PARALLEL.PP_SCHEDULE": schedule})
        sizes = sorted(_numel(m) for m in _rank_stages(cfg_s, 2, 0))
        numel = sum(sizes)
        got = rank_memory(cfg_s, Candidate(pp=2, fsdp=True, micro=4), 0)["gathered"]
        weights = 2 * block * compute_b
        if schedule == "interleaved":
            weights += sizes[-1] * compute_b  # the larger of its two stages
        assert got == numel * reduce_b + weights, schedule


def _amp_keys(amp: str) -> tuple[str, ...]:
    if amp == "fp32":
        return ("TRAIN.MIXED_PRECISION", "False")
    return ("TRAIN.MIXED_PRECISION", "True", "AMP.MODE", amp, "AMP.DTYPE", "bf16")


def test_fsdp_pipeline_peak_in_the_last_backward_when_weights_dominate():
    """With activation checkpointing (little kept per micro-batch) an FSDP
    pipeline rank peaks in its last backward: every stage's weights gathered
    and gradients unsharded, one micro-batch's activations through its stage."""
    cfg = tiny_cfg("TRAIN.BATCH_SIZE", "8", "VIT.NUM_LAYERS", "8",
                   "VIT.HIDDEN_DIM", "192", "VIT.MLP_DIM", "768",
                   "FSDP.ENABLED", "True", "MODEL.NUM_CLASSES", "10")  # fmt: skip
    numel = sum(_numel(m) for m in _rank_stages(cfg, 2, 0))
    ckpt = Candidate(pp=2, fsdp=True, checkpoint=True, micro=4)
    got = rank_memory(cfg, ckpt, 0)
    assert got["gathered"] == numel * (4 + 4)  # fp32 weights and gradients
    # One micro-batch (2 images) through the first stage's 4 blocks.
    assert got["activations"] == activation_bytes(cfg, 2, True, 1, 4)
