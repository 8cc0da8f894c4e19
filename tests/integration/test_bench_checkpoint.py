"""benchmarks/checkpoint_stall.py (make bench-checkpoint) at a tiny size: each round
saves once synchronously and once asynchronously, and its figures add up."""

import json
import statistics

from tests.helpers import run_benchmark


def test_checkpoint_benchmark_times_both_kinds_of_save(tmp_path):
    out = tmp_path / "stall.json"
    proc = run_benchmark(
        "checkpoint_stall", "--cfg", "configs/examples/vit_tiny_cpu.yaml",
        "--layers", "1", "--rounds", "2", "--json-out", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    rounds = report["rounds_detail"]
    assert len(rounds["sync"]) == len(rounds["async"]) == 2
    for r in rounds["sync"]:  # a synchronous save is all stall, nothing beside it
        assert r["lost_s"] == r["stall_s"] > 0 and r["steps_during_write"] == 0
    for r in rounds["async"]:
        n = r["steps_during_write"]
        slower = n * (r["step_during_write_s"] - r["step_s"]) if n else 0.0
        assert abs(r["lost_s"] - (r["stall_s"] + slower)) <= 1e-9 * max(r["lost_s"], 1)
    assert report["async_lost_s"] == statistics.median(
        r["lost_s"] for r in rounds["async"]
    )
    assert report["async_over_sync_lost"] == (
        report["async_lost_s"] / report["sync_lost_s"]
    )
    assert report["checkpoint_gb"] > 0 and report["params"] > 0
    assert "training time lost per checkpoint" in proc.stdout
