"""Fixtures shared by every test (helpers live in tests/helpers.py)."""

import pytest
import torch

from pycls_fast.datasets.digits import build_digits_folder


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def digits(tmp_path_factory):
    """scikit-learn's digits as an ImageNet folder of 16 px images (once a session)."""
    root = tmp_path_factory.mktemp("digits")
    build_digits_folder(str(root), size=16)
    return str(root)
