"""Fixtures shared by every test (helpers live in tests/helpers.py); the tests run
on the CPU.

The suite pins itself to the CPU (CUDA_VISIBLE_DEVICES="" for this process and the
processes it starts), so a GPU node runs the same tests as a laptop. `--gpu` or
PYCLS_FAST_TEST_GPU=1 leaves the GPUs visible and runs the tests marked `gpu` too.
"""

import os
import sys

GPU_TESTS = "--gpu" in sys.argv or os.environ.get("PYCLS_FAST_TEST_GPU") == "1"
if not GPU_TESTS:
    # Before torch initializes CUDA (lazily, at the first CUDA call).
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

import pytest  # noqa: E402
import torch  # noqa: E402

from pycls_fast.datasets.formats.digits import build_digits_folder  # noqa: E402


def pytest_addoption(parser):
    parser.addoption(
        "--gpu",
        action="store_true",
        help="leave the GPUs visible and run the tests marked gpu",
    )


def pytest_collection_modifyitems(config, items):
    if GPU_TESTS and torch.cuda.is_available():
        return
    reason = (
        "no CUDA device visible"
        if GPU_TESTS
        else "GPU test: run with --gpu or PYCLS_FAST_TEST_GPU=1 on a GPU node"
    )
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def digits(tmp_path_factory):
    """scikit-learn's digits as an ImageNet folder of 16 px images (once a session)."""
    root = tmp_path_factory.mktemp("digits")
    build_digits_folder(str(root), size=16)
    return str(root)
