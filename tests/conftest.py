"""Fixtures shared by every test (helpers live in tests/helpers.py); the tests run
on the CPU.

The suite pins itself to the CPU (CUDA_VISIBLE_DEVICES="" for this process and the
processes it starts), so a GPU node runs the same tests as a laptop. `--gpu` or
PYCLS_FAST_TEST_GPU=1 leaves the GPUs visible and runs the tests marked `gpu` too.

Nothing skips silently: the summary ends with the skipped tests counted by reason, and
under CI=true a skipped SLURM test fails the run (a CI machine must start SLURM jobs).
"""

import collections
import os
import platform
import sys

GPU_TESTS = "--gpu" in sys.argv or os.environ.get("PYCLS_FAST_TEST_GPU") == "1"
# OpenMP threads that finish a parallel region sleep instead of spinning: `make test`
# runs two test files at once, each often with processes of its own, so the cores
# are oversubscribed, and a spinning thread burns the core another test needs (two
# 2-thread trainings side by side took 30 s each spinning, 23-24 s passive). Set
# before torch loads its OpenMP runtime; the processes the tests start inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
if not GPU_TESTS:
    # Before torch initializes CUDA (lazily, at the first CUDA call).
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

import pytest  # noqa: E402
import torch  # noqa: E402

from pycls_fast import config  # noqa: E402
from pycls_fast.datasets.formats.digits import build_digits_folder  # noqa: E402
from tests.helpers import MKL_BRANCHES, mkl_branch  # noqa: E402


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
        else "CUDA-only (run with --gpu or PYCLS_FAST_TEST_GPU=1 on a GPU node)"
    )
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _fresh_config_warnings(monkeypatch):
    """Each test starts as a fresh process for the config's once-per-process warnings,
    so a test that expects one does not depend on which tests ran before it."""
    monkeypatch.setattr(config, "_warned", set())


@pytest.fixture(scope="session")
def digits(tmp_path_factory):
    """scikit-learn's digits as an ImageNet folder of 16 px images (once a session)."""
    root = tmp_path_factory.mktemp("digits")
    build_digits_folder(str(root), size=16)
    return str(root)


# Skips that CI=true turns into failures: on a CI machine SLURM must be installed
# (`make slurm`), so a SLURM test that skips means the claim went unchecked.
REQUIRED_IN_CI = ("tests/integration/test_slurm.py",)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if (
        report.skipped
        and os.environ.get("CI") == "true"
        and item.nodeid.startswith(REQUIRED_IN_CI)
    ):
        report.outcome = "failed"
        report.longrepr = f"skipped under CI=true: {_skip_reason(report)}"


def _skip_reason(report) -> str:
    """A skip's reason, without pytest's 'Skipped: ' prefix."""
    if isinstance(report.longrepr, tuple):  # (path, line, "Skipped: reason")
        return report.longrepr[2].removeprefix("Skipped: ")
    return str(report.longrepr)


def _cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), or the platform's processor string."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _mkl_description() -> str:
    """MKL's branch for this process, named (tests.helpers.mkl_branch)."""
    branch = mkl_branch()
    if branch is None:
        return "none"
    return MKL_BRANCHES.get(branch, f"branch {branch}")


def pytest_terminal_summary(terminalreporter):
    """One line per reason: how many tests skipped and why (GPU tests included);
    then the machine the suite ran on and MKL's kernels (tolerances must hold on
    every CPU kind)."""
    skipped = terminalreporter.stats.get("skipped", [])
    if skipped:
        reasons = collections.Counter(_skip_reason(r) for r in skipped)
        terminalreporter.section("skipped, by reason")
        for reason, count in reasons.most_common():
            terminalreporter.write_line(f"{count} skipped: {reason}")
    terminalreporter.write_line(
        f"ran on: {_cpu_model()}, {os.cpu_count()} cores, torch {torch.__version__},"
        f" MKL {_mkl_description()}"
    )
