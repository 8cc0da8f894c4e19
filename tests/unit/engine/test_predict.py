"""pycls_fast.engine.predict: a checkpoint loaded in one call, images prepared
exactly as the evaluation loader prepares them, top-k predictions."""

import logging
import os

import pytest
import torch
from PIL import Image

from pycls_fast.checkpoint.files import save_checkpoint
from pycls_fast.datasets.formats.index import load_index
from pycls_fast.datasets.loader import construct_test_loader
from pycls_fast.engine.predict import load_trained
from pycls_fast.errors import CheckpointError, UserError
from pycls_fast.models import build_model
from tests.helpers import tiny_cfg

CFG = ["TRAIN.IM_SIZE", "16", "TEST.IM_SIZE", "20", "VIT.PATCH_SIZE", "4",
       "DATA_LOADER.NUM_WORKERS", "0", "TEST.BATCH_SIZE", "8",
       "DATA.CHANNEL_ORDER", "rgb"]  # fmt: skip


def _run(tmp_path, digits, *opts):
    """A run folder holding one checkpoint of a tiny random ViT; (cfg, model)."""
    cfg = tiny_cfg(*CFG, "DATA.PATH", digits, "OUT_DIR", str(tmp_path), *opts)
    model = build_model(cfg)
    state = {"model_state": model.state_dict(), "cfg": cfg.dump(), "epoch": 1}
    save_checkpoint(cfg.OUT_DIR, state, 1)
    return cfg, model.eval()


def test_load_trained_from_run_folder(tmp_path, digits):
    cfg, model = _run(tmp_path, digits)
    trained = load_trained(str(tmp_path))
    assert trained.loaded.path.endswith("model_epoch_0001.pyth")
    assert not trained.model.training
    assert trained.cfg.VIT.HIDDEN_DIM == cfg.VIT.HIDDEN_DIM
    for k, v in model.state_dict().items():
        assert torch.equal(trained.model.state_dict()[k], v), k
    assert trained.classes == [f"digit_{i}" for i in range(10)]


def test_preprocess_is_the_evaluation_path(tmp_path, digits):
    # Non-default statistics: the config keys are what both paths use.
    stats = ["DATA.MEAN", "[0.5, 0.4, 0.3]", "DATA.STD", "[0.2, 0.25, 0.3]"]
    cfg, _ = _run(tmp_path, digits, *stats)
    trained = load_trained(str(tmp_path))
    images, _ = next(iter(construct_test_loader(cfg, 0, 1)))
    index = load_index(digits, "val")
    for i in range(3):
        path = index.path(i)
        got = trained.preprocess(path)
        assert got.shape == (1, 3, 16, 16) and got.dtype == torch.float32
        mean = torch.tensor([0.5, 0.4, 0.3]).view(3, 1, 1)
        std = torch.tensor([0.2, 0.25, 0.3]).view(3, 1, 1)
        want = (images[i].float() / 255 - mean) / std
        # Values within +-5: a few fp32 roundings (eps 2**-23) of x / (255 std) - m / s.
        torch.testing.assert_close(got[0], want, rtol=0, atol=8 * 2**-23 * 5)
        assert torch.equal(trained.preprocess(Image.open(path)), got)


def test_predict_top_k(tmp_path, digits):
    _run(tmp_path, digits)
    trained = load_trained(str(tmp_path / "checkpoints" / "model_epoch_0001.pyth"))
    path = os.path.join(digits, "val", "digit_3", sorted(
        os.listdir(os.path.join(digits, "val", "digit_3")))[0])  # fmt: skip
    top = trained.predict(path, k=3)
    probs = trained.model(trained.preprocess(path)).softmax(dim=1)[0]
    want = probs.topk(3)
    assert [c for c, _, _ in top] == want.indices.tolist()
    assert [n for _, n, _ in top] == [f"digit_{i}" for i in want.indices.tolist()]
    torch.testing.assert_close(
        torch.tensor([p for _, _, p in top]), want.values, rtol=0, atol=0
    )


def test_load_trained_says_which_weights_it_took(tmp_path, digits, caplog):
    cfg = tiny_cfg(*CFG, "DATA.PATH", digits, "OUT_DIR", str(tmp_path),
                   "OPTIM.MAX_EPOCH", "4")  # fmt: skip
    model = build_model(cfg)
    # A checkpoint taken during epoch 3 (2 completed, 5 iterations into the third).
    state = {"model_state": model.state_dict(), "cfg": cfg.dump(), "epoch": 2,
             "iter": 5}  # fmt: skip
    path = save_checkpoint(cfg.OUT_DIR, state, 2, 5)
    with caplog.at_level(logging.INFO, logger="pycls_fast"):
        trained = load_trained(str(tmp_path))
    lines = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert lines == [(logging.WARNING, f"load_trained: model weights of {path} "
                      "(taken during epoch 3/4, at iteration 5: the run had not "
                      "finished)")]  # fmt: skip
    assert trained.loaded.unfinished(4)
    # After the last epoch: said, not warned of.
    state = {**state, "epoch": 4, "iter": 0}
    path = save_checkpoint(cfg.OUT_DIR, state, 4)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pycls_fast"):
        load_trained(str(tmp_path))
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.INFO, f"load_trained: model weights of {path} (epoch 4/4)")
    ]


def test_load_trained_refuses_ema_weights_a_run_did_not_keep(tmp_path, digits):
    _run(tmp_path, digits)
    with pytest.raises(CheckpointError) as e:
        load_trained(str(tmp_path), ema=True)
    assert str(e.value).startswith(
        f"checkpoint {tmp_path}/checkpoints/model_epoch_0001.pyth holds no EMA "
        "weights (its run kept none: OPTIM.EMA_ALPHA 0)"
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without GPU")
def test_load_trained_on_a_missing_gpu_is_one_line(tmp_path, digits):
    _run(tmp_path, digits)
    with pytest.raises(UserError) as e:
        load_trained(str(tmp_path), device="cuda")
    assert str(e.value) == "device 'cuda': no CUDA GPU is visible here"
    with pytest.raises(UserError) as e:
        load_trained(str(tmp_path), device="gpu")
    assert str(e.value).startswith("device 'gpu': ")
