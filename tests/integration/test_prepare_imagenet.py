"""tools/prepare_imagenet.py on small archives made here in the official formats: a
tar of per-class tars, a flat validation tar, a devkit with meta.mat and the ground
truth."""

import io
import os
import tarfile

import numpy as np
import pytest
import scipy.io
from PIL import Image

from pycls_fast.datasets.formats import prepare
from pycls_fast.datasets.formats.index import load_index
from tests.helpers import run_tool

WNIDS = ["n01440764", "n01443537", "n01484850"]  # ILSVRC2012_ID 1, 2, 3
# Validation image k (1-based file number) -> ILSVRC2012_ID, as the ground truth says.
VAL_IDS = [3, 1, 2, 2, 3, 1]
TRAIN_PER_CLASS = 4


def _jpeg(seed):
    buf = io.BytesIO()
    Image.new("RGB", (20, 16), (seed * 40 % 256, 90, 160)).save(buf, format="JPEG")
    return buf.getvalue()


def _add(tar, name, data):
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def _train_tar(path):
    with tarfile.open(path, "w") as outer:
        for c, wnid in enumerate(WNIDS):
            buf = io.BytesIO()
            with tarfile.open(fileobj=buf, mode="w") as inner:
                for k in range(TRAIN_PER_CLASS):
                    _add(inner, f"{wnid}_{k + 1}.JPEG", _jpeg(c * 10 + k))
            _add(outer, f"{wnid}.tar", buf.getvalue())


def _val_tar(path):
    with tarfile.open(path, "w") as tar:
        for k in reversed(range(len(VAL_IDS))):  # stored out of order on purpose
            _add(tar, f"ILSVRC2012_val_{k + 1:08d}.JPEG", _jpeg(100 + k))


def _devkit(path, tmp):
    # meta.mat as the devkit has it: one struct per synset, leaves (no children) first,
    # then a non-leaf synset that must be ignored.
    fields = ["ILSVRC2012_ID", "WNID", "words", "gloss", "num_children"]
    synsets = np.zeros((len(WNIDS) + 1, 1), dtype=[(f, "O") for f in fields])
    for i, wnid in enumerate(WNIDS):
        synsets[i, 0] = (i + 1, wnid, f"class {i}, alias {i}", "gloss", 0)
    synsets[-1, 0] = (1001, "n00001740", "entity", "gloss", 3)
    data = os.path.join(tmp, "ILSVRC2012_devkit_t12", "data")
    os.makedirs(data)
    scipy.io.savemat(os.path.join(data, "meta.mat"), {"synsets": synsets})
    with open(os.path.join(data, "ILSVRC2012_validation_ground_truth.txt"), "w") as f:
        f.write("".join(f"{i}\n" for i in VAL_IDS))
    with tarfile.open(path, "w:gz") as tar:
        tar.add(os.path.join(tmp, "ILSVRC2012_devkit_t12"), "ILSVRC2012_devkit_t12")


@pytest.fixture()
def archives(tmp_path):
    folder = tmp_path / "archives"
    folder.mkdir()
    _train_tar(folder / prepare.TRAIN_TAR)
    _val_tar(folder / prepare.VAL_TAR)
    _devkit(folder / prepare.DEVKIT, str(tmp_path / "devkit_src"))
    return folder


def test_archives_to_the_folder_layout(archives, tmp_path):
    out = tmp_path / "imagenet"
    result = run_tool("prepare_imagenet.py",
        "--archives", str(archives), "--out", str(out), "--no-md5")  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "train: 3 classes, 12 images" in result.stdout
    assert "val: 3 classes, 6 images" in result.stdout
    train = load_index(str(out), "train")
    assert train.classes == WNIDS
    assert os.path.basename(train.path(5)) == "n01443537_2.JPEG"
    assert train.read(5) == _jpeg(10 + 1)  # the bytes, unchanged
    val = load_index(str(out), "val")
    got = {os.path.basename(val.path(i)): WNIDS[val.labels[i]] for i in range(len(val))}
    want = {
        f"ILSVRC2012_val_{k + 1:08d}.JPEG": WNIDS[i - 1] for k, i in enumerate(VAL_IDS)
    }
    assert got == want
    # Nothing half-done is left behind.
    assert not [p for p in out.rglob("*") if ".partial" in p.name]


def test_an_interrupted_run_continues(archives, tmp_path):
    out = str(tmp_path / "imagenet")
    seen = []

    def stop_after_two(done, total):
        seen.append(done)
        if done == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        prepare.extract_train(str(archives / prepare.TRAIN_TAR), out, stop_after_two)
    # As if killed inside the third class: a staging folder with part of it.
    partial = os.path.join(out, "train", f".{WNIDS[2]}.partial")
    os.makedirs(partial)
    open(os.path.join(partial, "junk.JPEG"), "w").close()
    first = os.stat(os.path.join(out, "train", WNIDS[0])).st_ino
    assert prepare.extract_train(str(archives / prepare.TRAIN_TAR), out) == 1
    assert os.stat(os.path.join(out, "train", WNIDS[0])).st_ino == first  # kept
    assert not os.path.exists(partial)
    assert sorted(os.listdir(os.path.join(out, "train", WNIDS[2]))) == [
        f"{WNIDS[2]}_{k + 1}.JPEG" for k in range(TRAIN_PER_CLASS)
    ]
    # Validation: a run stopped after some images writes only the rest next time.
    _, wnids = prepare.parse_devkit(str(archives / prepare.DEVKIT), check_md5=False)
    assert wnids == [WNIDS[i - 1] for i in VAL_IDS]
    os.makedirs(os.path.join(out, "val", wnids[0]))
    with open(
        os.path.join(out, "val", wnids[0], "ILSVRC2012_val_00000001.JPEG"), "wb"
    ) as f:
        f.write(_jpeg(100))
    assert prepare.extract_val(str(archives / prepare.VAL_TAR), out, wnids) == 5
    assert prepare.extract_val(str(archives / prepare.VAL_TAR), out, wnids) == 0


def test_user_errors(archives, tmp_path):
    result = run_tool("prepare_imagenet.py",
        "--archives", str(tmp_path), "--out", str(tmp_path / "o"))  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: archive not found: {tmp_path / prepare.TRAIN_TAR}"
    ]
    # The devkit generated here is not the official file: its MD5 is refused unless
    # --no-md5 says to go on.
    result = run_tool("prepare_imagenet.py", "--archives", str(archives),
        "--out", str(tmp_path / "o"), "--splits", "val")  # fmt: skip
    assert result.returncode == 2
    assert "MD5 is not the official archive's" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
