"""benchmarks/ladder_dist.py under torchrun (2 gloo processes) and one process, and
benchmarks/ladder_plots.py on the two records: structure and values of the report,
never timings."""

import json
import math
import os
import subprocess
import sys

from benchmarks.ladder_dist import RUNGS, rung_configs
from pycls_fast.config import load_cfg
from tests.helpers import ROOT, amp_loss_tolerance, run_benchmark

EXAMPLE = os.path.join(ROOT, "configs/examples/vit_tiny_cpu.yaml")
SMALL = ["VIT.NUM_LAYERS", "1", "VIT.HIDDEN_DIM", "32", "VIT.MLP_DIM", "64"]
ARGS = ["--cfg", EXAMPLE, "--batch", "8", "--rounds", "1", "--iters", "1",
        "--warmup", "0", "--large-size", "48", *SMALL]  # fmt: skip
PNG = b"\x89PNG\r\n\x1a\n"


def test_rungs_start_from_ddp_fp32_and_add_one_optimization_each():
    rungs = rung_configs(EXAMPLE, [], 8, 2, 48)
    got = [
        (n, c.FSDP.ENABLED, c.AMP.MODE, c.OPTIM.MTA, c.VIT.CLASSIFIER_TYPE,
         c.VIT.LAYOUT, c.TRAIN.IM_SIZE)
        for n, _, c in rungs
    ]  # fmt: skip
    assert got == [
        ("ddp", False, "fp32", False, "token", "batch_first", 32),
        ("amp", False, "O1", False, "token", "batch_first", 32),
        ("fsdp", True, "O1", False, "token", "batch_first", 32),
        ("mta", True, "O1", True, "token", "batch_first", 32),
        ("pooled", True, "O1", True, "pooled", "batch_first", 32),
        ("batch_second", True, "O1", True, "pooled", "batch_second", 32),
        ("amp_o2", True, "O2", True, "pooled", "batch_second", 32),
        ("im256", True, "O2", True, "pooled", "batch_second", 48),
        ("o3", True, "O3", True, "pooled", "batch_second", 48),
    ]
    assert all(c.NUM_GPUS == 2 and c.TRAIN.BATCH_SIZE == 8 for _, _, c in rungs)


def _is_png(path):
    with open(path, "rb") as f:
        return f.read(8) == PNG and os.path.getsize(path) > 10_000


def test_distributed_ladder_records_and_figures(tmp_path):
    two = tmp_path / "two.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "-m", "benchmarks.ladder_dist", *ARGS, "--json-out", str(two),
           "--plot-dir", str(tmp_path / "two")]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads(two.read_text())
    assert record["devices"] == 2 and record["batch"] == 8
    rows = {r["name"]: r for r in record["rows"]}
    assert list(rows) == [name for name, _, _ in RUNGS]
    assert rows["ddp"]["vs_baseline"] == 1.0 and rows["ddp"]["dtype"] == "float32"
    assert all(
        r["tflops_per_device"] > 0 and r["vs_baseline"] > 0 for r in rows.values()
    )
    # DDP and FSDP at the same precision: the same loss after one update. The
    # zero-initialized head makes the first loss log(classes) and the first update
    # the head's only: the trunk's forward is the same; the head's updates may part
    # by one bf16 rounding of each weight (eps relative), so the second losses part
    # by at most eps times the distance the loss travelled (amp_loss_tolerance with
    # no forward rounding placed apart).
    first = math.log(load_cfg(EXAMPLE, SMALL).MODEL.NUM_CLASSES)
    ddp, fsdp = rows["amp"]["second_loss"], rows["fsdp"]["second_loss"]
    assert ddp < first and fsdp < first
    assert abs(ddp - fsdp) <= amp_loss_tolerance([first, ddp, fsdp], roundings=0)
    assert rows["im256"]["im_size"] == 48
    assert record["optimized"] == "amp_o2"
    assert record["epoch_hours_optimized"] == rows["amp_o2"]["epoch_hours"]
    # The table names every rung; the figures are PNGs.
    for r in rows.values():
        assert f"| {r['label']} |" in result.stdout
    assert _is_png(tmp_path / "two/ladder.png")
    assert _is_png(tmp_path / "two/epoch_time.png")

    one = tmp_path / "one.json"
    result = run_benchmark(
        "ladder_dist", *ARGS, "--steps", "ddp,amp,amp_o2", "--json-out", str(one)
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(one.read_text())["devices"] == 1
    result = run_benchmark(
        "ladder_plots", str(one), str(two), "--out-dir", str(tmp_path / "plots")
    )
    assert result.returncode == 0, result.stderr
    for name in ("scaling.png", "ladder.png", "epoch_time.png"):
        assert _is_png(tmp_path / "plots" / name), name
    bad = run_benchmark("ladder_plots", str(tmp_path / "nope.json"), "--out-dir", "x")
    assert bad.returncode == 2 and "cannot read ladder record" in bad.stderr
