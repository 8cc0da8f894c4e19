"""benchmarks/fsdp_units.py: the O2 norms' FSDP wrapping, old and new, side by side."""

import re
import subprocess
import sys

from tests.helpers import ROOT


def test_fsdp_units_benchmark_compares_the_wrappings():
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.fsdp_units", "--rounds", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    losses = dict(re.findall(r"^(.+): losses (\[.*\])$", run.stdout, re.M))
    assert list(losses) == ["O1", "O2, a unit per norm", "O2, one unit for the norms"]
    # The wrapping changes no number: both O2 runs take the same three steps.
    assert losses["O2, a unit per norm"] == losses["O2, one unit for the norms"]
    steps = re.findall(r"^(.+): step ([\d.]+) ms \(([\d.]+)x O1\)$", run.stdout, re.M)
    assert [s[0] for s in steps] == list(losses)
    assert steps[0][2] == "1.00" and all(float(s[1]) > 0 for s in steps)
