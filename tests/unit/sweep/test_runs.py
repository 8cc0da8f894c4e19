"""A run's status and failure line from its files (sweep/runs.py)."""

import os

import pytest

from pycls_fast.sweep.runs import failure_line, run_status, write_json


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


def _log(tmp_path, text, code=1):
    run = _ended(tmp_path, code)
    with open(os.path.join(run["out_dir"], "launch.log"), "w") as f:
        f.write(text)
    return run


H1 = "--- 2024-01-01 10:00:00 ['python', 'tools/train_net.py']\n"
H2 = "--- 2024-01-01 11:00:00 ['python', 'tools/train_net.py']\n"


def test_the_failure_line_is_the_last_attempts_error(tmp_path):
    run = _log(tmp_path, H1 + "error: old cause\n" + H2 + "x\nerror: new cause\n")
    assert failure_line(run) == "error: new cause"
    run = _log(tmp_path, H1 + "error: old\n" + H2 + "Traceback\nValueError: bad\n")
    assert failure_line(run) == "ValueError: bad"


def test_the_launchers_header_is_never_the_failure_line(tmp_path):
    run = _log(tmp_path, H1 + "error: an older attempt's cause\n" + H2, code=3)
    line = failure_line(run)
    assert not line.startswith("---") and "older" not in line
    assert "exit status 3" in line
    assert "exit status 3" in failure_line(_log(tmp_path, H1, code=3))


def test_collect_keeps_the_last_record_of_each_epoch(tmp_path):
    """A rerun's epochs replace the earlier attempt's, in epoch order."""
    from pycls_fast.observe.logging import dump_json_stats
    from pycls_fast.sweep.collect import collect_run

    run = _ended(tmp_path, 1)
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("OPTIM: {BASE_LR: 0.1}\n")
    run.update(index=0, name="run", cfg_file=str(cfg), overrides={}, complexity={})

    def rec(kind, e, err):
        return {"_type": kind, "epoch": f"{e}/3", "top1_err": err, "time_epoch_s": 1}

    attempts = [
        rec(k, e, 90.0) for e in (1, 2, 3) for k in ("train_epoch", "test_epoch")
    ]
    attempts += [
        rec(k, e, 10.0 * e) for e in (1, 2) for k in ("train_epoch", "test_epoch")
    ]
    with open(os.path.join(run["out_dir"], "stdout.log"), "w") as f:
        f.writelines(f"[x] {dump_json_stats(r)}\n" for r in attempts)
    entry = collect_run(run)
    tests = entry["json_stats"]["test_epoch"]
    assert [(r["epoch"], r["top1_err"]) for r in tests] == [
        ("1/3", 10.0),
        ("2/3", 20.0),
        ("3/3", 90.0),
    ]
    assert len(entry["json_stats"]["train_epoch"]) == 3
