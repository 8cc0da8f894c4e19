"""timm users' habits, as they meet the tools: timm's flags name the config key they
mean (one line, exit 2), a timm model name is a --cfg, a timm augmentation string is
checked before OUT_DIR exists."""

import json

import pytest

from tests.helpers import DIGITS_CFG, run_tool


@pytest.mark.parametrize(
    "args, line",
    [
        (["--lr", "0.01"], "here it is the config key OPTIM.BASE_LR (used as given: "
         "never scaled by the batch size or NUM_GPUS): OPTIM.BASE_LR 0.01"),
        (["--epochs=5"], "the config key OPTIM.MAX_EPOCH: OPTIM.MAX_EPOCH 5"),
        (["--batch-size", "256"], "TRAIN.BATCH_SIZE (the batch of all processes "
         "together; timm's is per process): TRAIN.BATCH_SIZE 256"),
        (["--model", "vit_small_patch16_224"], ": --cfg vit_small_patch16_224"),
        (["--amp"], "--amp is timm's flag; here it is the config key AMP.MODE O1"),
    ],
)  # fmt: skip
def test_timm_flags_name_their_key(args, line):
    result = run_tool("train_net.py", "--cfg", DIGITS_CFG, *args)
    assert result.returncode == 2
    assert line in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_a_timm_name_is_a_config():
    result = run_tool("info_net.py", "--cfg", "vit_small_patch16_224", "--json")
    assert result.returncode == 0, result.stderr
    assert "configs/vit/ViT-S-16.yaml VIT.CLASSIFIER_TYPE token LN.EPS 1e-6" in (
        result.stdout
    )
    # timm's vit_small_patch16_224 has 22,050,664 parameters (1000 classes).
    assert json.loads(result.stdout.strip().splitlines()[-1])["params"] == 22050664


def test_a_misspelled_timm_name_gets_the_close_one():
    result = run_tool("info_net.py", "--cfg", "vit_smal_patch16_224", "--summary")
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(
        "error: --cfg vit_smal_patch16_224: no such config file, nor a timm ViT name "
        "known here (did you mean vit_small_patch16_224? known: vit_tiny_patch16_224,"
    )


def test_a_bad_augment_string_is_refused_before_out_dir_exists(tmp_path):
    out = tmp_path / "run"
    result = run_tool("train_net.py", "--cfg", DIGITS_CFG, "OUT_DIR", str(out),
                      "TRAIN.AUGMENT", "rand-x9-mstd0.5")  # fmt: skip
    assert result.returncode == 2
    assert "TRAIN.AUGMENT" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not out.exists()


def test_augmix_on_the_device_is_refused_before_out_dir_exists(tmp_path):
    out = tmp_path / "run"
    words = "AugMix"
    over = ["TRAIN.AUGMENT", "augmix-m5-w4-d2", "TRAIN.AUGMENT_BACKEND", "device"]
    result = run_tool("train_net.py", "--cfg", DIGITS_CFG, "OUT_DIR", str(out), *over)
    assert result.returncode == 2
    assert words in result.stderr and "TRAIN.AUGMENT_BACKEND" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not out.exists()
