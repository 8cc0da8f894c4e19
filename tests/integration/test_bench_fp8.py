"""benchmarks/fp8.py at a tiny scale with torchao's emulation on the CPU: the three
variants, their figures and table (never timings), the same batches and initial
weights for each loss curve."""

import json
import math

from tests.helpers import TINY, run_benchmark

TINY16 = [*TINY, "VIT.HIDDEN_DIM", "32", "VIT.MLP_DIM", "64"]


def test_fp8_benchmark_smoke(tmp_path):
    result = run_benchmark("fp8",
        "--cfgs", "configs/vit/ViT-B-16.yaml", "--batch", "4", "--rounds", "1",
        "--iters", "1", "--warmup", "1", "--loss-steps", "3", "--emulate",
        "--out-dir", str(tmp_path), *TINY16,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads((tmp_path / "fp8.json").read_text())
    rows = figures["configs/vit/ViT-B-16.yaml"]
    assert list(rows) == ["bf16", "fp8_tensorwise", "fp8_rowwise"]
    for row in rows.values():
        assert row["img_per_s"] > 0 and row["speedup"] > 0
        assert len(row["losses"]) == 3 and all(map(math.isfinite, row["losses"]))
        # The same first batch from the same initial weights: float8's first loss
        # is bf16's but for the float8 roundings of the forward.
        assert abs(row["losses"][0] - rows["bf16"]["losses"][0]) < 0.1
    assert rows["bf16"]["loss_vs_bf16"] == 1.0 and rows["bf16"]["speedup"] == 1.0
    table = (tmp_path / "fp8.md").read_text()
    assert "| ViT-B-16 | fp8_rowwise |" in table
