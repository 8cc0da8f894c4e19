"""Shared test helpers: tiny configs, seeded."""

import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from pycls_fast.config import load_cfg  # noqa: E402
from pycls_fast.datasets.digits import build_digits_folder  # noqa: E402

DIGITS_CFG = os.path.join(ROOT, "configs/examples/vit_digits.yaml")

TINY = [
    "TRAIN.IM_SIZE", "32",
    "TEST.IM_SIZE", "32",
    "VIT.PATCH_SIZE", "8",
    "VIT.HIDDEN_DIM", "48",
    "VIT.NUM_HEADS", "4",
    "VIT.MLP_DIM", "96",
    "VIT.NUM_LAYERS", "2",
    "MODEL.NUM_CLASSES", "10",
    "LN.EPS", "1e-6",
]  # fmt: skip


def tiny_cfg(*opts):
    """A checked config for a tiny ViT (32 px, 8 px patches, width 48, 2 blocks)."""
    return load_cfg(None, TINY + list(opts))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def digits(tmp_path_factory):
    """scikit-learn's digits as an ImageNet folder of 16 px images (once a session)."""
    root = tmp_path_factory.mktemp("digits")
    build_digits_folder(str(root), size=16)
    return str(root)
