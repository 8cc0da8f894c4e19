"""The planner's choices: the fastest layout that fits, FSDP's shares, activation
checkpointing's savings, and none when nothing fits."""

from pycls_fast.core.planner import GIB, per_rank_memory, plan
from tests.helpers import tiny_cfg


def test_fsdp_shards_the_state_and_checkpointing_the_activations():
    cfg = tiny_cfg("TRAIN.BATCH_SIZE", "64", "OPTIM.OPTIMIZER", "adamw")
    ddp = per_rank_memory(cfg, 4, fsdp=False)
    fsdp = per_rank_memory(cfg, 4, fsdp=True)
    ac = per_rank_memory(cfg, 4, fsdp=True, checkpoint=True)
    assert ddp["optimizer"] == 2 * ddp["params"]  # Adam: two fp32 moments
    assert fsdp["params"] < 0.3 * ddp["params"]  # about a quarter, chunks rounded up
    assert fsdp["gathered"] > 0 and ddp["gathered"] == 0
    assert ac["activations"] < fsdp["activations"]
    assert ddp["activations"] == fsdp["activations"]
    assert per_rank_memory(cfg, 8, False)["activations"] * 2 == ddp["activations"]


def test_the_fastest_layout_that_fits_is_chosen():
    cfg = tiny_cfg("TRAIN.BATCH_SIZE", "64")
    rows = {r.layout: r for r in plan(cfg, 2, 80)[1]}
    assert plan(cfg, 2, 80)[0].layout == "ddp"  # everything fits: no gathering
    tight = (rows["fsdp+ac"].memory["total"] + 1) / (0.9 * GIB)
    best, _ = plan(cfg, 2, tight)
    assert best.layout == "fsdp+ac"
    best, _ = plan(cfg, 2, tight / 2)
    assert best is None
