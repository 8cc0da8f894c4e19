"""benchmarks/ladder.py: the rungs' configs, and one tiny end-to-end run (structure and
values of the report, never timings)."""

import json
import os

import pytest

from benchmarks.ladder import rung_configs
from tests.helpers import ROOT, assert_help_lists, run_benchmark

EXAMPLE = os.path.join(ROOT, "configs/examples/vit_tiny_cpu.yaml")


def test_each_rung_adds_one_optimization_to_the_one_before():
    rungs = rung_configs(EXAMPLE, [], 8)
    got = [
        (name, c.AMP.MODE, c.OPTIM.MTA, c.VIT.CLASSIFIER_TYPE, c.VIT.LAYOUT)
        for name, _, c in rungs
    ]
    assert got == [
        ("baseline", "fp32", False, "token", "batch_first"),
        ("amp", "O1", False, "token", "batch_first"),
        ("mta", "O1", True, "token", "batch_first"),
        ("pooled", "O1", True, "pooled", "batch_first"),
        ("batch_second", "O1", True, "pooled", "batch_second"),
        ("amp_o2", "O2", True, "pooled", "batch_second"),
        ("compile", "O2", True, "pooled", "batch_second"),
        ("loader", "O2", True, "pooled", "batch_second"),
    ]
    assert all(c.TRAIN.BATCH_SIZE == 8 and c.NUM_GPUS == 1 for _, _, c in rungs)
    assert not any(c.TRAIN.MIXED_PRECISION for _, _, c in rungs[:1])


def test_tiny_ladder_report(tmp_path):
    chart = tmp_path / "ladder.png"
    result = run_benchmark("ladder",
        "--cfg", EXAMPLE, "--batch", "2", "--rounds", "1", "--iters", "1",
        "--warmup", "0", "--steps", "baseline,amp,pooled,loader", "--peers", "timm",
        "--workers", "1", "--plot", str(chart), "--json",
        "VIT.NUM_LAYERS", "1", "DATA_LOADER.PREFETCH", "1",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout.strip().splitlines()[-1])
    rows = {r["name"]: r for r in record["rows"]}
    assert list(rows) == ["baseline", "amp", "pooled", "loader", "timm"]
    assert rows["baseline"]["vs_first"] == 1.0
    assert rows["baseline"]["dtype"] == "float32"
    assert {rows[n]["dtype"] for n in ("amp", "pooled", "loader", "timm")} == {
        "bfloat16"
    }
    peaks = record["matmul_peak_gflops"]
    assert set(peaks) == {"torch.float32", "torch.bfloat16"}
    for r in rows.values():
        # MFU = achieved FLOP/s over the measured peak of the row's dtype.
        peak = peaks[f"torch.{r['dtype']}"] * 1e9
        assert r["mfu"] == pytest.approx(r["tflops"] * 1e12 / peak)
        assert r["img_per_s_min"] <= r["img_per_s"] <= r["img_per_s_max"]
    # Pooled tiny ViT (1 block, width 64, 64 tokens): 3 x 2 x forward MACs per image.
    from pycls_fast.config import load_cfg
    from pycls_fast.models import complexity

    cfg = load_cfg(EXAMPLE, ["VIT.NUM_LAYERS", "1", "VIT.CLASSIFIER_TYPE", "pooled"])
    step_s = 2 / rows["pooled"]["img_per_s"]
    flops = 6 * complexity(cfg)["flops"] * 2 / step_s
    assert rows["pooled"]["tflops"] * 1e12 == pytest.approx(flops)
    assert record["ours_best_vs_timm"] == pytest.approx(
        max(rows[n]["img_per_s"] for n in ("baseline", "amp", "pooled"))
        / rows["timm"]["img_per_s"]
    )
    assert chart.stat().st_size > 1000
    assert "| fp32 baseline | float32 |" in result.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--steps", "baseline,fast"], "unknown rung 'fast'"),
        (["--peers", "vit"], "unknown peer 'vit'"),
        (["--rounds", "0"], "--rounds must be >= 1"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(args, message):
    result = run_benchmark("ladder", "--cfg", EXAMPLE, *args)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {message}")


def test_help():
    result = run_benchmark("ladder", "--help")
    assert_help_lists("benchmarks/ladder.py", result)
    assert "baseline" in result.stdout
