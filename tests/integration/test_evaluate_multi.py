"""test_net with TEST.SIZES, TEST.EXTRA_SPLITS (an ImageNet-V2-style folder of label
numbers) and TEST.REAL_LABELS: one table, each row what a single evaluation gives."""

import json
import os
import shutil

import pytest
import torch

from pycls_fast.config import load_cfg
from pycls_fast.models import build_model
from pycls_fast.observe.logging import load_json_stats
from tests.helpers import DIGITS_CFG, JSON_REL, run_tool

SMALL = ["VIT.NUM_LAYERS", "1", "VIT.HIDDEN_DIM", "32", "VIT.MLP_DIM", "64",
         "VIT.CLASSIFIER_TYPE", "token", "TRAIN.IM_SIZE", "16", "TEST.IM_SIZE", "16",
         "TEST.BATCH_SIZE", "64"]  # fmt: skip


def _imagenet_like(digits, root):
    """digits' val split renamed as ImageNet's (ILSVRC2012_val_<n>), the same images
    again as a V2-style split (folders 0..9), and the train split linked."""
    os.symlink(os.path.join(digits, "train"), os.path.join(root, "train"))
    classes = sorted(os.listdir(os.path.join(digits, "val")))
    truth = []
    for label, cls in enumerate(classes):
        for name in sorted(os.listdir(os.path.join(digits, "val", cls))):
            truth.append(label)
            n = len(truth)
            for split, folder in (("val", cls), ("v2", str(label))):
                dest = os.path.join(root, split, folder)
                os.makedirs(dest, exist_ok=True)
                shutil.copy(
                    os.path.join(digits, "val", cls, name),
                    os.path.join(dest, f"ILSVRC2012_val_{n:08d}.png"),
                )
    return truth


def _eval(root, weights, out, *opts):
    result = run_tool("test_net.py", "--cfg", DIGITS_CFG, "DATA.PATH", root, *SMALL,
                      "TEST.WEIGHTS", weights, "OUT_DIR", str(out), *opts)  # fmt: skip
    assert result.returncode == 0, result.stderr
    records = [r for r in load_json_stats(str(out / "stdout.log"))
               if r["_type"] == "test_epoch"]  # fmt: skip
    return result.stdout, records


def test_sizes_splits_and_real_labels_in_one_run(digits, tmp_path):
    root = tmp_path / "data"
    root.mkdir()
    truth = _imagenet_like(digits, str(root))
    torch.manual_seed(0)
    model = build_model(load_cfg(DIGITS_CFG, SMALL))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(std=0.3)
    weights = str(tmp_path / "w.pyth")
    torch.save(model.state_dict(), weights)
    # ReaL labels: the true label for most images, every label for a few (always
    # right), none for others (left out).
    real = [[t] for t in truth]
    for k in range(0, len(real), 7):
        real[k] = list(range(10))
    for k in range(3, len(real), 11):
        real[k] = []
    real_path = tmp_path / "real.json"
    real_path.write_text(json.dumps(real))
    stdout, records = _eval(root, weights, tmp_path / "multi",
                            "TEST.SIZES", "[16, 24]", "TEST.EXTRA_SPLITS", "['v2']",
                            "TEST.REAL_LABELS", str(real_path))  # fmt: skip
    assert [(r["im_size"], r["split"]) for r in records] == [
        (16, "val"),
        (16, "v2"),
        (24, "val"),
        (24, "v2"),
    ]
    assert "| split | classes | size | top-1 | top-5 | ReaL top-1 |" in stdout
    # The V2-style folders of label numbers hold the same images: the same results.
    for a, b in ((0, 1), (2, 3)):
        assert records[a]["top1_err"] == records[b]["top1_err"]
    # Each row is what a single evaluation at that size gives.
    for i, (size, resize) in enumerate((("16", "16"), ("24", "24"))):
        _, single = _eval(root, weights, tmp_path / f"single{size}",
                          "TRAIN.IM_SIZE", size, "TEST.IM_SIZE", resize)  # fmt: skip
        assert single[0]["loss"] == records[2 * i]["loss"]
    assert records[0]["loss"] != records[2]["loss"]  # the size mattered
    # ReaL: counted images exclude the empty lists; always-right images raise top-1.
    counted = sum(1 for r in real if r)
    assert records[0]["real_images"] == records[2]["real_images"] == counted
    assert records[0]["real_top1_err"] < records[0]["top1_err"]
    assert "real_top1_err" not in records[1]
    # With every image's true label only, ReaL top-1 is top-1.
    exact = tmp_path / "exact.json"
    exact.write_text(json.dumps([[t] for t in truth]))
    _, rec = _eval(root, weights, tmp_path / "exact", "TEST.REAL_LABELS", str(exact))
    # The same count over the same images; each figure logged to 6 digits.
    assert rec[0]["real_top1_err"] == pytest.approx(
        rec[0]["top1_err"], rel=2 * JSON_REL
    )


def test_real_labels_under_pipeline_and_fsdp_with_unequal_shares(digits, tmp_path):
    # 33 test images over 2 ranks at 4 a batch: shares of 17 and 16 images, 5 and 4
    # batches. ReaL went around the pipeline (a crash under PP) and FSDP's ranks ran
    # unequal forwards (a hang). Both must give the one process's ReaL error.
    root = tmp_path / "data"
    root.mkdir()
    truth = _imagenet_like(digits, str(root))
    # 33 of them, every class kept (the folder is in class order).
    kept = {1 + round(k * (len(truth) - 1) / 32) for k in range(33)}
    for cls in os.listdir(root / "val"):
        for name in os.listdir(root / "val" / cls):
            if int(name.split("_")[-1].split(".")[0]) not in kept:
                os.remove(root / "val" / cls / name)
    torch.manual_seed(0)
    small = [*SMALL, "VIT.NUM_LAYERS", "2", "TEST.BATCH_SIZE", "8"]
    model = build_model(load_cfg(DIGITS_CFG, small))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(std=0.3)
    weights = str(tmp_path / "w.pyth")
    torch.save(model.state_dict(), weights)
    real = [[t] if k % 5 else [t, (t + 1) % 10] for k, t in enumerate(truth)]
    real_path = tmp_path / "real.json"
    real_path.write_text(json.dumps(real))
    opts = ["VIT.NUM_LAYERS", "2", "TEST.BATCH_SIZE", "8",
            "TEST.REAL_LABELS", str(real_path), "DIST.TIMEOUT_S", "60"]  # fmt: skip
    _, (one,) = _eval(root, weights, tmp_path / "one", *opts)
    assert one["real_images"] == 33 and one["images"] == 33
    for name, layout in (
        ("pp2", ["NUM_GPUS", "2", "PARALLEL.PP", "2"]),
        ("fsdp2", ["NUM_GPUS", "2", "FSDP.ENABLED", "True"]),
    ):
        _, (rec,) = _eval(root, weights, tmp_path / name, *opts, *layout)
        assert rec["real_images"] == 33, name
        assert rec["real_top1_err"] == one["real_top1_err"], name
        assert rec["top1_err"] == one["top1_err"], name
