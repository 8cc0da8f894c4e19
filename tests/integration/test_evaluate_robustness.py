"""test_net on ImageNet-A, -R and -Sketch in one run, from folders in each set's real
layout (tiny JPEGs made here): A and R read from the 1000-class logits masked to
their 200 classes (timm's lists), Sketch as all 1000; one table and one JSON file per
checkpoint; each row what an independent computation from the images gives."""

import io
import json
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from pycls_fast.config import load_cfg
from pycls_fast.datasets.formats.synthetic import _source_photos, make_image
from pycls_fast.datasets.to_device.transform import MEAN, STD
from pycls_fast.engine.test_sets import timm_class_list
from pycls_fast.models import build_model
from pycls_fast.observe.logging import load_json_stats
from tests.helpers import (
    DIGITS_CFG,
    JSON_REL,
    order_tolerance,
    rounding_tolerance,
    run_tool,
    vit_roundings,
)

pytestmark = pytest.mark.slow  # trains an epoch, then evaluates 2,400 images

SIZE = 16
# A 1000-class ViT small enough to train an epoch on 1,000 images in seconds, in fp32
# so that the independent computation below is the same arithmetic.
MODEL = ["MODEL.NUM_CLASSES", "1000", "VIT.NUM_LAYERS", "1", "VIT.HIDDEN_DIM", "32",
         "VIT.MLP_DIM", "64", "VIT.NUM_HEADS", "2", "TRAIN.IM_SIZE", str(SIZE),
         "TEST.IM_SIZE", str(SIZE), "TRAIN.MIXED_PRECISION", "False",
         "AMP.MODE", "fp32", "TEST.BATCH_SIZE", "250", "TRAIN.BATCH_SIZE", "100",
         "OPTIM.MAX_EPOCH", "1", "OPTIM.WARMUP_EPOCHS", "0",
         "DATA.CROP_SCALE", "[1.0, 1.0]", "DATA_LOADER.NUM_WORKERS", "2"]  # fmt: skip


def _jpegs(count, seed):
    """`count` distinct tiny photo-like JPEGs (bytes)."""
    rng = np.random.default_rng(seed)
    photos = _source_photos()
    out = []
    for _ in range(count):
        buf = io.BytesIO()
        make_image(rng, photos, (SIZE, SIZE)).save(buf, "JPEG", quality=95)
        out.append(buf.getvalue())
    return out


def _write_set(root, folder, synsets, name_of, pool, offset):
    """root/folder/<synset>/<name_of(i)>, one image per class (picked from `pool`),
    and a README.txt beside the class folders, as the releases have."""
    for i, synset in enumerate(synsets):
        d = os.path.join(root, folder, synset)
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, name_of(i)), "wb") as f:
            f.write(pool[(i * 7 + offset) % len(pool)])
    with open(os.path.join(root, folder, "README.txt"), "w") as f:
        f.write(f"{folder}: generated for a test\n")


def _make_sets(root):
    pool = _jpegs(48, seed=0)
    imagenet = timm_class_list("imagenet_synsets")
    a = timm_class_list("imagenet_a_synsets")
    r = timm_class_list("imagenet_r_synsets")
    _write_set(root, "val", imagenet, lambda i: f"ILSVRC2012_val_{i + 1:08d}.JPEG",
               pool, 0)  # fmt: skip
    # ImageNet-A: <score>_<label> _ <prediction>_<score>.jpg; -R: <style>_<n>.jpg.
    _write_set(root, "imagenet-a", a, lambda i: f"0.{i:06d}_x _ y_0.5.jpg", pool, 1)
    _write_set(root, "imagenet-r", r, lambda i: f"art_{i}.jpg", pool, 2)
    _write_set(root, "sketch", imagenet, lambda i: f"sketch_{i}.JPEG", pool, 3)
    return {"imagenet-a": a, "imagenet-r": r, "sketch": imagenet}


def _expected(model, root, split, columns):
    """(loss, top-1 err %, top-5 err %, largest |logit|, images) of `model` on
    root/split, computed here from the files: decode, normalize, logits, keep
    `columns` (None: all)."""
    classes = sorted(os.listdir(os.path.join(root, split)))
    classes = [c for c in classes if os.path.isdir(os.path.join(root, split, c))]
    images, labels = [], []
    for label, c in enumerate(classes):
        for name in sorted(os.listdir(os.path.join(root, split, c))):
            im = Image.open(os.path.join(root, split, c, name)).convert("RGB")
            images.append(np.asarray(im, dtype=np.float32) / 255.0)
            labels.append(label)
    x = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2)
    x = (x - torch.tensor(MEAN).view(1, 3, 1, 1)) / torch.tensor(STD).view(1, 3, 1, 1)
    with torch.no_grad():
        logits = model(x)
    if columns is not None:
        logits = logits[:, columns]
    y = torch.tensor(labels)
    top5 = logits.topk(5, dim=1).indices
    top1_err = 100.0 * (1 - (top5[:, 0] == y).float().mean().item())
    top5_err = 100.0 * (1 - (top5 == y[:, None]).any(dim=1).float().mean().item())
    loss = F.cross_entropy(logits, y).item()
    return loss, top1_err, top5_err, logits.abs().max().item(), len(y)


def test_imagenet_a_r_sketch_in_one_run(tmp_path):
    root = str(tmp_path / "data")
    sets = _make_sets(root)
    out = tmp_path / "run"
    # Trained on the Sketch-layout split (its 1,000 synset folders in ImageNet's
    # order are the model's classes), one epoch.
    train = run_tool("train_net.py", "--cfg", DIGITS_CFG, *MODEL, "DATA.PATH", root,
                     "TRAIN.SPLIT", "sketch", "OUT_DIR", str(out))  # fmt: skip
    assert train.returncode == 0, train.stderr
    extra = "['imagenet-a', 'imagenet-r', 'sketch']"
    result = run_tool("test_net.py", "--run", str(out), "DATA.PATH", root,
                      "TRAIN.SPLIT", "absent", "TEST.EXTRA_SPLITS", extra)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "| split | classes | size | top-1 | top-5 |" in result.stdout
    assert "| imagenet-a (ImageNet-A) | 200 | 16 |" in result.stdout
    assert "| imagenet-r (ImageNet-R) | 200 | 16 |" in result.stdout
    assert "| sketch | 1000 | 16 |" in result.stdout
    records = [r for r in load_json_stats(str(out / "eval" / "stdout.log"))
               if r["_type"] == "test_epoch"]  # fmt: skip
    assert [(r["split"], r["classes"], r.get("subset")) for r in records] == [
        ("val", 1000, None),
        ("imagenet-a", 200, "ImageNet-A"),
        ("imagenet-r", 200, "ImageNet-R"),
        ("sketch", 1000, None),
    ]
    # One JSON file for the checkpoint, holding the same records and the table.
    report = json.loads((out / "eval" / "eval_model_epoch_0001.json").read_text())
    assert report["checkpoint"].endswith("model_epoch_0001.pyth")
    assert [r["split"] for r in report["records"]] == [r["split"] for r in records]
    assert report["table"] in result.stdout
    # Each row is what the images give through the model, masked to the 200 logits
    # of timm's index lists for A and R (read here from timm's own files).
    cfg = load_cfg(DIGITS_CFG, MODEL)
    model = build_model(cfg).eval()
    ckpt = torch.load(out / "checkpoints" / "model_epoch_0001.pyth", weights_only=True)
    model.load_state_dict(ckpt["model_state"])
    imagenet = timm_class_list("imagenet_synsets")
    for record in records:
        columns = None
        if record["split"] in ("imagenet-a", "imagenet-r"):
            key = "imagenet_a" if record["split"] == "imagenet-a" else "imagenet_r"
            columns = [int(i) for i in timm_class_list(f"{key}_indices")]
            assert columns == [imagenet.index(s) for s in sets[record["split"]]]
        loss, top1, top5, largest, n = _expected(model, root, record["split"], columns)
        # Two fp32 forwards of one function in other orders (normalization +4):
        # each logit errs by the counted roundings of the largest logit, and
        # cross-entropy's slope in the logits is at most 2 (L1); the means over n
        # images are fp32 sums in other orders; the log keeps 6 digits (JSON_REL).
        # Errors are counts of images: the same count up to those sums' rounding.
        forward = rounding_tolerance(torch.float32, vit_roundings(1) + 4)
        mean = order_tolerance(torch.float32, n)
        loss_tol = 2 * forward * largest + (mean + 2 * JSON_REL) * loss
        assert abs(record["loss"] - loss) <= loss_tol, record
        for key, want in (("top1_err", top1), ("top5_err", top5)):
            tol = mean * 100.0 + 2 * JSON_REL * want
            assert abs(record[key] - want) <= tol, (key, record)
    # Masking mattered: A's loss over 200 classes is below its loss over all 1000.
    unmasked = _expected(model, root, "imagenet-a", None)[0]
    assert records[1]["loss"] < unmasked - 0.5


def test_subset_not_of_the_model_classes_is_refused(tmp_path):
    root = str(tmp_path / "data")
    pool = _jpegs(2, seed=1)
    _write_set(root, "val", ["n00000001", "n00000002"], lambda i: f"{i}.JPEG", pool, 0)
    _write_set(root, "odd", ["n00000001", "n09999999"], lambda i: f"{i}.JPEG", pool, 0)
    model = build_model(load_cfg(DIGITS_CFG, MODEL))
    weights = str(tmp_path / "w.pyth")
    torch.save(model.state_dict(), weights)
    out = str(tmp_path / "o")
    result = run_tool("test_net.py", "--cfg", DIGITS_CFG, *MODEL, "DATA.PATH", root,
                      "TRAIN.SPLIT", "val", "TEST.WEIGHTS", weights,
                      "TEST.EXTRA_SPLITS", "['odd']", "OUT_DIR", out)  # fmt: skip
    assert result.returncode == 2
    assert "n09999999" in result.stderr and "odd" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
