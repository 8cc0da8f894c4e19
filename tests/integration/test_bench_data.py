"""benchmarks/shards.py and benchmarks/loader_scaling.py at a small scale: the
figures' structure and the counts that do not depend on timing."""

import json
import statistics

import pytest

from tests.helpers import EXACT, run_benchmark


def test_shards_benchmark_counts_calls(tmp_path):
    out = tmp_path / "shards.json"
    result = run_benchmark("shards",
        "--root", str(tmp_path / "data"), "--images", "256", "--batch-size", "32",
        "--workers", "2", "--shard-mb", "4", "--rounds", "1", "--json", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert figures["images"] == 256
    folder, shards = figures["calls"]["folder_epoch"], figures["calls"]["shards_epoch"]
    # A folder: an open, an fstat and a read per image. Shards: a positional read per
    # image, an open per shard, no stat.
    assert folder["open"] == folder["fstat"] == folder["read"] == 256
    num_shards = len(list((tmp_path / "data").glob("shards_4mb/train/*.tar")))
    assert shards["pread"] == 256 and shards["open"] == num_shards > 1
    assert shards["stat"] + shards["fstat"] == 0
    assert figures["shards_img_per_s"] > 0 and figures["folder_img_per_s"] > 0


def test_loader_scaling_benchmark(tmp_path):
    out = tmp_path / "scaling.json"
    result = run_benchmark("loader_scaling",
        "--root", str(tmp_path / "data"), "--images", "64", "--batch-size", "16",
        "--im-size", "64", "--json", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert 0 < figures["gil_ms"] < figures["cpu_ms"]
    assert figures["released_ms"] > 0
    assert {row["model"] for row in figures["gpu_demand"]} == {"ViT-B-16", "ViT-H-16"}
    # Projected images/s with one thread is 1 / CPU time per image.
    assert figures["checks"]["1"]["projected"] == pytest.approx(
        1e3 / figures["cpu_ms"], rel=EXACT["rtol"]
    )


def test_contention_benchmark(tmp_path):
    out = tmp_path / "contention.json"
    result = run_benchmark("contention",
        "--gen-dir", str(tmp_path / "data"), "--images", "64", "--im-size", "64",
        "--batch-size", "4", "--rounds", "2", "--seconds", "0.3", "--step-depth", "2",
        "--recipes", "deit", "--modes", "none,idle,busy,threads,subprocess",
        "--max-tries", "1", "--json", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    cells = [(r["recipe"], r["mode"]) for r in rows]
    assert cells == [
        ("deit", "none"), ("deit", "idle"), ("deit", "busy"), ("deit", "threads"),
        ("deit", "subprocess"),
    ]  # fmt: skip
    alone = rows[0]
    # The step alone is its own reference, round by round.
    assert alone["slowdown_rounds"] == [1.0, 1.0]
    for row in rows:
        assert row["step_cpu_ms"] > 0 and row["step_ms"] > 0
        assert len(row["slowdown_rounds"]) == 2
        assert (row["img_per_s"] > 0) == (row["mode"] not in ("none", "idle", "busy"))
    assert "| deit | subprocess |" in result.stdout
    assert "| deit | busy |" in result.stdout
    # The busy control's child ran in its runs (a 0.3 s run on a loaded machine
    # still gives a runnable process tens of ms), and only the busy cell has one.
    # The idle control sleeps --idle-ms (25) before each step: its loop waits that
    # long for each "batch"; the step alone never waits.
    assert rows[1]["next_ms"] >= 25 > 1 > alone["next_ms"]
    busy = rows[2]
    assert busy["busy_cpu_s"] > 0.02, busy
    assert all(r["busy_cpu_s"] == 0 for r in rows if r["mode"] != "busy")
    # Each cell over the busy control, round by round: the control over itself 1.
    assert busy["over_busy"] == 1.0
    for row in rows:
        ratios = [r / b for r, b in zip(row["step_rounds_ms"], busy["step_rounds_ms"])]
        assert row["over_busy"] == pytest.approx(statistics.median(ratios))
