"""benchmarks/real_run.py at a tiny size on the CPU: every cell's figures, the
profile of the slowest, the table."""

import json

from pycls_fast.datasets.formats.synthetic import make_image_folder
from tests.helpers import TINY, run_benchmark


def test_real_run_benchmark(tmp_path):
    data = make_image_folder(
        str(tmp_path / "data"), ("train",), num_classes=2, images_per_class=8,
        size=(64, 48),
    )  # fmt: skip
    out = tmp_path / "out"
    result = run_benchmark("real_run",
        "--cfg", "configs/vit/ViT-B-16.yaml", "--data", data, "--amp", "fp32",
        "--modes", "threads,subprocess", "--recipes", "crop-flip",
        "--steps", "3", "--warmup", "2", "--profile-steps", "2", "--out", str(out),
        *TINY, "MODEL.NUM_CLASSES", "2", "TRAIN.BATCH_SIZE", "4",
        "DATA_LOADER.NUM_WORKERS", "1", "NUM_GPUS", "1",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads((out / "real_run.json").read_text())
    cells = [(r["recipe"], r["mode"]) for r in figures["rows"]]
    assert cells == [("crop-flip", "threads"), ("crop-flip", "subprocess")]
    for row in figures["rows"]:
        assert row["amp"] == "fp32" and not row["cuda_graphs"]
        assert row["real_img_per_s"] > 0 and row["step_img_per_s"] > 0
        assert row["real_over_step"] == row["real_img_per_s"] / row["step_img_per_s"]
        assert 0 <= row["data_wait_frac"] <= 1
    slowest = min(figures["rows"], key=lambda r: r["real_over_step"])
    assert figures["profile"] == str(out / "profile")
    assert (out / "profile" / "trace.json").stat().st_size > 0
    assert "Self CPU" in (out / "profile" / "operators.txt").read_text()
    table = (out / "real_run.md").read_text()
    assert table.count("\n| fp32 |") == 2 and "real / step" in table
    assert f"({slowest['amp']}, {slowest['recipe']}, {slowest['mode']})" in (
        result.stdout
    )
