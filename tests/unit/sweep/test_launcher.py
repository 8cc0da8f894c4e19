"""The local sweep backend (sweep/launcher.py): concurrent runs get disjoint GPUs."""

import json
import os
import sys

import pytest

from pycls_fast.errors import UserError
from pycls_fast.sweep.launcher import Job, LocalBackend, visible_gpus

# Each job records the GPUs it was given and when it ran.
RECORD = (
    "import json, os, sys, time; t0 = time.time(); time.sleep(0.3); "
    "json.dump({'gpus': os.environ.get('CUDA_VISIBLE_DEVICES'), 't0': t0, "
    "'t1': time.time()}, open(sys.argv[1], 'w'))"
)


def _run_all(backend, jobs):
    backend.submit(jobs)
    most = 0
    while backend.wait():
        most = max(most, len(backend.running))
    return most


def _records(jobs):
    return [json.load(open(os.path.join(j.out_dir, "rec.json"))) for j in jobs]


@pytest.mark.parametrize("per_run, at_once", [(1, 4), (2, 2), (3, 1)])
def test_concurrent_runs_get_disjoint_gpus(tmp_path, per_run, at_once):
    jobs = [Job(f"r{i}", "", str(tmp_path / f"r{i}")) for i in range(5)]
    backend = LocalBackend(
        lambda job: [
            sys.executable,
            "-c",
            RECORD,
            os.path.join(job.out_dir, "rec.json"),
        ],
        max_parallel=8,
        poll_s=0.02,
        devices=["0", "1", "2", "3"],  # a node of 4 GPUs, faked
        gpus_per_run=per_run,
    )
    assert backend.max_parallel == at_once  # bounded by the GPUs, not by 8
    assert _run_all(backend, jobs) == at_once
    records = _records(jobs)
    for r in records:
        assert len(r["gpus"].split(",")) == per_run
    for a in records:
        for b in records:
            overlap = a is not b and a["t0"] < b["t1"] and b["t0"] < a["t1"]
            if overlap:
                assert not set(a["gpus"].split(",")) & set(b["gpus"].split(","))


def test_no_gpus_no_assignment_and_too_few_refused(tmp_path):
    job = Job("r", "", str(tmp_path / "r"))
    backend = LocalBackend(
        lambda job: [
            sys.executable,
            "-c",
            RECORD,
            os.path.join(job.out_dir, "rec.json"),
        ],
        max_parallel=2,
        poll_s=0.02,
        env={k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"},
    )
    _run_all(backend, [job])
    assert _records([job])[0]["gpus"] is None
    with pytest.raises(UserError, match="NUM_GPUS 3 needs more GPUs than the 2"):
        LocalBackend(lambda job: [], devices=["0", "1"], gpus_per_run=3)


def test_visible_gpus_follow_cuda_visible_devices():
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2, 5"}) == ["2", "5"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []
