"""benchmarks/index.py at a small scale: the tree, the figures' structure and values
(never timings)."""

import json
import os

from tests.helpers import run_benchmark


def test_small_index_benchmark(tmp_path):
    out = tmp_path / "result.json"
    result = run_benchmark("index",
        "--classes", "4", "--per-class", "30", "--root", str(tmp_path / "tree"),
        "--out-dir", str(tmp_path / "out"), "--json", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert figures["images"] == 4 * 30 and figures["classes"] == 4
    for key in ("cold_s", "cached_s", "first_step_cold_s", "first_step_cached_s"):
        assert figures[key] > 0
    # The cold run wrote the cache that the cached run read.
    cache = os.listdir(tmp_path / "out" / "cache" / "data_index")
    assert [name.startswith("index_train_") for name in cache] == [True]
    # Every train image is a hard link to its class's one source file.
    image = tmp_path / "tree" / "train" / "n00000003" / "n00000003_29.JPEG"
    assert os.stat(image).st_nlink == 30 + 50 + 1
