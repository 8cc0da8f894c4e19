"""Each shipped config's layout (PARALLEL.TP / PP, FSDP, activation checkpointing)
is the planner's choice for the hardware it names: NUM_GPUS GPUs of 80 GB, the H100
that the planner's speed model assumes (tools/plan_net.py --gpu-gib 80)."""

import glob
import os

import pytest

from pycls_fast.config import load_cfg
from pycls_fast.parallel.planner import plan
from tests.helpers import ROOT

SHIPPED = sorted(
    p
    for folder in ("vit", "pycls", "deit", "augreg")
    for p in glob.glob(os.path.join(ROOT, "configs", folder, "*.yaml"))
)


@pytest.mark.parametrize("path", SHIPPED, ids=os.path.basename)
def test_shipped_layout_is_the_planners(path):
    cfg = load_cfg(path)
    best, _ = plan(cfg, cfg.NUM_GPUS, 80)
    assert best is not None, "no layout fits"
    c = best.layout
    planned = (c.tp, c.pp, c.fsdp, c.checkpoint)
    shipped = (cfg.PARALLEL.TP, cfg.PARALLEL.PP, cfg.FSDP.ENABLED,
               cfg.FSDP.ACTIVATION_CHECKPOINT)  # fmt: skip
    assert shipped == planned, f"plan_net chooses {c.name}"
    if c.pp > 1:
        assert c.micro == cfg.PARALLEL.PP_MICROBATCHES
