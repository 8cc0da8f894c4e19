"""A run's status and failure line from its files (sweep/runs.py)."""

import os

import pytest

from pycls_fast.sweep.runs import run_status, write_json


def _ended(tmp_path, code):
    run = {"out_dir": str(tmp_path / "run")}
    os.makedirs(run["out_dir"], exist_ok=True)
    write_json(os.path.join(run["out_dir"], "exit_status.json"), {"exit_code": code})
    return run


@pytest.mark.parametrize("code", [-9, -15, -2, 137, 143, 130])
def test_a_run_stopped_by_a_signal_is_incomplete(tmp_path, code):
    """Popen reports a signal as -N, a shell (or SLURM) as 128 + N: both resume."""
    assert run_status(_ended(tmp_path, code)) == "incomplete"


@pytest.mark.parametrize("code", [1, 2, 127])
def test_a_run_that_exited_with_an_error_failed(tmp_path, code):
    assert run_status(_ended(tmp_path, code)) == "failed"
