"""TRAIN.SIZE_SCHEDULE: progressive resolution, from the config's stages to the
loader's crops, the model's positions, the log and an exact resume mid-schedule."""

import os
import shutil

import pytest
import torch

from pycls_fast import checkpoint as ckpt
from pycls_fast.checkpoint.weights import resample_pos_embedding
from pycls_fast.config import ConfigError, load_cfg, train_stage
from pycls_fast.datasets.loader import construct_train_loader
from pycls_fast.engine.trainer import train_model
from pycls_fast.models import build_model
from pycls_fast.observe.logging import load_json_stats
from tests.helpers import DIGITS_CFG, tiny_cfg

SCHEDULE = "[[0, 8, 64], [1, 12, 128], [2, 16, 128]]"


def test_stages_by_epoch():
    cfg = tiny_cfg("TRAIN.IM_SIZE", "32", "TRAIN.SIZE_SCHEDULE",
                   "[[0, 16, 32], [3, 24, 16], [5, 32, 8]]")  # fmt: skip
    got = [train_stage(cfg, e) for e in range(7)]
    assert got == [(16, 32)] * 3 + [(24, 16)] * 2 + [(32, 8)] * 2
    plain = tiny_cfg()
    assert train_stage(plain, 5) == (32, plain.TRAIN.BATCH_SIZE)


@pytest.mark.parametrize(
    "schedule, match",
    [
        ("[[1, 16, 32], [2, 32, 32]]", "start at 0"),
        ("[[0, 16, 32], [0, 32, 32]]", "start at 0 and increase"),
        ("[[0, 16, 32], [2, 24, 32]]", "must be TRAIN.IM_SIZE"),
        ("[[0, 12, 32], [2, 32, 32]]", "multiple of VIT.PATCH_SIZE"),
        ("[[0, 16, 31], [2, 32, 32]]", "data-parallel ranks"),
        ("[[0, 16], [2, 32, 32]]", "each stage is"),
    ],
)
def test_bad_schedules_are_one_line(schedule, match):
    with pytest.raises(ConfigError, match=f"TRAIN.SIZE_SCHEDULE.*{match}"):
        tiny_cfg("NUM_GPUS", "2", "TRAIN.BATCH_SIZE", "32",
                 "TRAIN.SIZE_SCHEDULE", schedule)  # fmt: skip


def test_smaller_images_use_the_resampled_positions():
    """A model built at 32 px run on 16 px images adds the position embedding
    resampled as a checkpoint loaded at 16 px would be: same logits as that model;
    gradients reach the stored embedding."""
    big = build_model(tiny_cfg()).eval()
    with torch.no_grad():
        big.pos_embedding.normal_(std=0.5)
        big.head.head_fc.weight.normal_()  # pycls zero-inits the head
    small_cfg = tiny_cfg("TRAIN.IM_SIZE", "16", "TEST.IM_SIZE", "16")
    small = build_model(small_cfg).eval()
    state = dict(big.state_dict())
    assert resample_pos_embedding(state, small.state_dict()) is not None
    small.load_state_dict(state)
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(big(x), small(x), rtol=0, atol=0)
    big.train()
    big(x).sum().backward()
    assert big.pos_embedding.grad is not None and big.pos_embedding.grad.abs().sum() > 0


def _cfg(digits, out_dir, *opts):
    return load_cfg(
        DIGITS_CFG,
        [
            "DATA.PATH", digits, "OUT_DIR", str(out_dir),
            "TRAIN.IM_SIZE", "16", "TEST.IM_SIZE", "16",
            "VIT.NUM_LAYERS", "2", "VIT.HIDDEN_DIM", "32", "VIT.MLP_DIM", "64",
            "TRAIN.BATCH_SIZE", "128", "TEST.BATCH_SIZE", "200",
            "OPTIM.MAX_EPOCH", "3", "OPTIM.WARMUP_EPOCHS", "1",
            "OPTIM.BASE_LR", "0.005", "TRAIN.CHECKPOINT_PERIOD", "1",
            "LOG_PERIOD", "5", "DATA_LOADER.NUM_WORKERS", "2",
            "TRAIN.SIZE_SCHEDULE", SCHEDULE, *opts,
        ],
    )  # fmt: skip


def test_loader_crops_and_batches_follow_the_schedule(digits, tmp_path):
    loader = construct_train_loader(_cfg(digits, tmp_path), 0, 1)
    shapes = {}
    for epoch in range(3):
        loader.set_epoch(epoch)
        images, _ = next(iter(loader))
        shapes[epoch] = (tuple(images.shape), len(loader))
    n = 1438  # digits' train split
    assert shapes == {
        0: ((64, 3, 8, 8), n // 64),
        1: ((128, 3, 12, 12), n // 128),
        2: ((128, 3, 16, 16), n // 128),
    }


def test_resume_mid_schedule_ends_with_identical_weights(digits, tmp_path):
    opts = ["TRAIN.CHECKPOINT_ITER_PERIOD", "4", "TRAIN.MIXUP_ALPHA", "0.2",
            "VIT.DROP_PATH", "0.1"]  # fmt: skip
    full = tmp_path / "full"
    train_model(_cfg(digits, full, *opts))
    log = (full / "stdout.log").read_text()
    assert "resolution stage 2/3 from epoch 2: 12 px, batch 128" in log
    epochs = [r for r in load_json_stats(str(full / "stdout.log"))
              if r["_type"] == "train_epoch"]  # fmt: skip
    assert len(epochs) == 3

    def iteration_steps(run):
        return [(r["iter"], r["global_iter"])
                for r in load_json_stats(str(run / "stdout.log"))
                if r["_type"] == "train_iter"]  # fmt: skip

    # The curves' x: iterations over the epochs, 22 of batch 64 then 11 of 128.
    assert iteration_steps(full) == [
        ("5/22", 5), ("10/22", 10), ("15/22", 15), ("20/22", 20),
        ("5/11", 27), ("10/11", 32), ("5/11", 38), ("10/11", 43),
    ]  # fmt: skip
    # A crash 4 iterations into epoch 2 (the 12 px stage), then a resume.
    crashed = tmp_path / "crashed"
    shutil.copytree(full, crashed)
    paths = ckpt.list_checkpoints(str(crashed))
    names = [os.path.basename(p) for p in paths]
    keep = names.index("model_epoch_0002_iter_000004.pyth")
    for path in paths[keep + 1 :]:
        os.remove(path)
    train_model(_cfg(digits, crashed, *opts))
    a = torch.load(full / "checkpoints/model_epoch_0003.pyth", weights_only=False)
    b = torch.load(crashed / "checkpoints/model_epoch_0003.pyth", weights_only=False)
    for key in a["model_state"]:
        assert torch.equal(a["model_state"][key], b["model_state"][key]), key
    # Resumed 4 iterations into epoch 2, it counts the same iterations.
    assert iteration_steps(crashed)[-3:] == iteration_steps(full)[-3:]
    resumed_log = (crashed / "stdout.log").read_text().split("resumed from")[-1]
    assert "resolution stage 2/3 from epoch 2: 12 px, batch 128" in resumed_log
