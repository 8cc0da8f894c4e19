"""benchmarks/augment_cost.py at a small scale: every recipe family under each path,
the figures' structure and the arithmetic that does not depend on timing."""

import json

import pytest

from tests.helpers import EXACT, run_benchmark


def test_augment_cost_benchmark(tmp_path):
    out = tmp_path / "augment.json"
    result = run_benchmark("augment_cost",
        "--root", str(tmp_path / "data"), "--images", "8", "--im-size", "32",
        "--rounds", "1", "--gil-rounds", "1", "--max-others", "1000", "--ops",
        "--batch", "4", "--json", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert figures["images"] == 8 and figures["im_size"] == 32
    results = figures["results"]
    recipes = {(r["recipe"], r["backend"]) for r in results.values()}
    families = ("AutoAugment (pycls)", "DeiT RandAugment",
                "DeiT III 3-Augment + jitter", "AugReg RandAugment")  # fmt: skip
    assert recipes == {("pycls crop + flip", "tensor")} | {
        (f, b) for f in families for b in ("pil", "tensor", "device")
    }
    for r in results.values():
        assert r["cpu_ms"] > 0 and r["gil_ms"] <= r["cpu_ms"]
        # Cores per GPU: the step's images/s times the CPU seconds per image.
        for mode, rate in figures["h100_step_img_per_s"].items():
            want = rate * r["cpu_ms"] / 1e3
            assert r["cores_per_h100"][mode] == pytest.approx(want, rel=EXACT["rtol"])
    assert results["pycls crop + flip"]["vs_baseline"] == 1.0
    assert {row["op"] for row in figures["ops"]} >= {"Rotate", "ShearX", "Equalize"}
    assert "| DeiT RandAugment | tensor |" in result.stdout
    # The device backend's policies, timed on this machine's device (the CPU).
    rows = figures["device_policies"]
    assert [r["recipe"] for r in rows] == list(families)
    for r in rows:
        assert r["device"] == "cpu" and r["batch"] == 4
        assert r["device_ms"] > 0 and r["ops_per_batch"] > 0
    assert "| DeiT RandAugment | cpu | 4 |" in result.stdout
