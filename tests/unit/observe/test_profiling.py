"""PROF.*: the trace and the operator table of the profiled steps, in OUT_DIR."""

import json
import os

from pycls_fast.config import load_cfg
from pycls_fast.engine.trainer import train_model
from tests.helpers import DIGITS_CFG

# torch.optim's record_function around each optimizer step.
OPTIMIZER_STEP = "Optimizer.step#AdamW.step"


def test_profiled_steps_write_a_trace_and_a_table(digits, tmp_path):
    cfg = load_cfg(DIGITS_CFG, [
        "DATA.PATH", digits, "OUT_DIR", str(tmp_path), "TRAIN.IM_SIZE", "16",
        "TEST.IM_SIZE", "16", "VIT.NUM_LAYERS", "1", "VIT.HIDDEN_DIM", "32",
        "VIT.MLP_DIM", "64", "TRAIN.BATCH_SIZE", "256", "TEST.BATCH_SIZE", "400",
        "OPTIM.MAX_EPOCH", "1", "DATA_LOADER.NUM_WORKERS", "1",
        "PROF.ENABLED", "True", "PROF.START", "2", "PROF.STEPS", "2",
    ])  # fmt: skip
    train_model(cfg)
    folder = tmp_path / "profile"
    assert sorted(os.listdir(folder)) == ["ops_rank0.txt", "trace_rank0.json"]
    trace = json.loads((folder / "trace_rank0.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    # The profiled steps ran the model's matmuls and the fused optimizer: PROF.STEPS
    # optimizer steps, no fewer (the profiler once started a step late).
    assert {"aten::addmm", "aten::mm"} & names
    steps = [e for e in trace["traceEvents"] if e.get("name") == OPTIMIZER_STEP]
    assert len(steps) == 2
    table = (folder / "ops_rank0.txt").read_text()
    assert table.startswith("steps 3..4 of rank 0, sorted by self_cpu_time_total")
    assert "Self CPU" in table
    log = (tmp_path / "stdout.log").read_text()
    assert "profile of steps 3..4" in log


def test_a_run_shorter_than_the_window_writes_what_it_profiled(digits, tmp_path):
    cfg = load_cfg(DIGITS_CFG, [
        "DATA.PATH", digits, "OUT_DIR", str(tmp_path), "TRAIN.IM_SIZE", "16",
        "TEST.IM_SIZE", "16", "VIT.NUM_LAYERS", "1", "VIT.HIDDEN_DIM", "32",
        "VIT.MLP_DIM", "64", "TRAIN.BATCH_SIZE", "512", "TEST.BATCH_SIZE", "400",
        "OPTIM.MAX_EPOCH", "1", "DATA_LOADER.NUM_WORKERS", "1",
        "PROF.ENABLED", "True", "PROF.START", "1", "PROF.STEPS", "50",
    ])  # fmt: skip
    train_model(cfg)  # 2 steps: step 2 profiled, then the run ends
    table = (tmp_path / "profile" / "ops_rank0.txt").read_text()
    assert table.startswith("steps 2..2 of rank 0")
