"""Collecting a sweep: every run's config, complexity, status and json_stats in one
file, ROOT_DIR/NAME/sweep.json (pycls's name), which the analysis reads.

    sweep_data = collect_sweep(sweep)   # also writes sweep.json

Per run: index, name, status (done / failed / incomplete / missing), overrides (the
swept values), complexity, cfg (the fork as a dict), exit_code, error (a failed run's
last error line), summary (final and best test top-1 error, epochs done, mean train
epoch time) and json_stats {train_epoch, test_epoch, test_ema_epoch: [records]} (the
train_iter records are left out, as pycls does, to keep the file small; an epoch
logged again by a rerun or a resume keeps its last record, in epoch order).
"""

import collections
import os
from collections.abc import Mapping
from typing import Any

import yaml
from yacs.config import CfgNode

from pycls_fast.errors import UserError
from pycls_fast.observe.logging import last_per_epoch
from pycls_fast.sweep.config import sweep_dir
from pycls_fast.sweep.runs import (
    exit_status,
    failure_line,
    read_json,
    records,
    run_status,
    write_json,
)
from pycls_fast.sweep.setup import load_forks

SWEEP_FILE = "sweep.json"
KEPT_TYPES = ("train_epoch", "test_epoch", "test_ema_epoch")


def _epoch(record: Mapping[str, Any]) -> tuple[int, int]:
    done, _, total = str(record.get("epoch", "0/0")).partition("/")
    return int(done), int(total or 0)


def summarize(stats: Mapping[str, list[dict]]) -> dict[str, Any]:
    """Final and best test top-1 error, epochs done / total, mean train epoch time."""
    tests, trains = stats.get("test_epoch", []), stats.get("train_epoch", [])
    return {
        "top1_err": tests[-1]["top1_err"] if tests else None,
        "min_top1_err": min(r["top1_err"] for r in tests) if tests else None,
        "epochs_done": _epoch(trains[-1])[0] if trains else 0,
        "epochs_total": _epoch(trains[-1])[1] if trains else None,
        "time_epoch_s": (
            sum(r["time_epoch_s"] for r in trains) / len(trains) if trains else None
        ),
    }


def collect_run(run: Mapping[str, Any]) -> dict[str, Any]:
    """One run's entry of sweep.json (see the module's docstring)."""
    all_records = records(run)
    stats = collections.defaultdict(list)
    for r in last_per_epoch(r for r in all_records if r.get("_type") in KEPT_TYPES):
        stats[r["_type"]].append(r)
    status = run_status(run, all_records)
    ended = exit_status(run) or {}
    with open(run["cfg_file"]) as f:
        cfg = yaml.safe_load(f)
    return {
        "index": run["index"],
        "name": run["name"],
        "status": status,
        "out_dir": run["out_dir"],
        "cfg_file": run["cfg_file"],
        "overrides": run["overrides"],
        "complexity": run["complexity"],
        "exit_code": ended.get("exit_code"),
        "seconds": ended.get("seconds"),
        "error": failure_line(run) if status == "failed" else "",
        "summary": summarize(stats),
        "json_stats": dict(stats),
        "cfg": cfg,
    }


def collect_sweep(sweep: CfgNode) -> dict[str, Any]:
    """Collects every run of the sweep into ROOT_DIR/NAME/sweep.json; returns it as
    {"name", "desc", "swept_keys", "counts": {status: n}, "runs": [...]}."""
    forks = load_forks(sweep)
    runs = [collect_run(run) for run in forks["runs"]]
    data = {
        "name": sweep.NAME,
        "desc": sweep.DESC,
        "swept_keys": forks["swept_keys"],
        "counts": dict(collections.Counter(r["status"] for r in runs)),
        "runs": runs,
    }
    write_json(os.path.join(sweep_dir(sweep), SWEEP_FILE), data)
    return data


def load_sweep_data(sweep: CfgNode) -> dict[str, Any]:
    """sweep.json of a collected sweep; UserError when it was not collected."""
    path = os.path.join(sweep_dir(sweep), SWEEP_FILE)
    data = read_json(path)
    if data is None:
        raise UserError(f"{path} not found: collect the sweep first (sweep_collect.py)")
    return data
