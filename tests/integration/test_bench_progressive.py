"""benchmarks/progressive.py (make bench-progressive) at a tiny size: every stage
timed beside the fixed size, and the projection adds up."""

import json

from tests.helpers import run_benchmark


def test_progressive_benchmark_projects_the_schedule(tmp_path):
    out = tmp_path / "progressive.json"
    proc = run_benchmark(
        "progressive", "--cfg", "configs/examples/vit_tiny_cpu.yaml",
        "--schedule", "[[0, 16, 64], [3, 32, 64]]", "--epochs", "5",
        "--rounds", "1", "--batch", "4", "--json-out", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert [(s["size"], s["epochs"]) for s in report["stages"]] == [(16, 3), (32, 2)]
    last = report["stages"][-1]
    assert last["vs_fixed"] == 1.0  # the last stage is the fixed size
    total = sum(s["epoch_h"] * s["epochs"] for s in report["stages"])
    assert abs(report["schedule_h"] - total) <= 1e-9 * total
    assert abs(report["speedup"] - report["fixed_h"] / total) <= 1e-9
    assert report["fixed_h"] == last["epoch_h"] * 5
    assert "schedule" in proc.stdout and "vs fixed 32 px" in proc.stdout
