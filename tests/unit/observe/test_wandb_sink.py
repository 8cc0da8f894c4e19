"""The W&B sink with the real wandb package in offline mode (no server): the run's
transaction log, read back, holds the config, the records and the summary; a second
start in the same OUT_DIR continues the same run."""

import logging
import time

import pytest

from pycls_fast.observe.logging import log_json_stats, setup_logging
from pycls_fast.observe.stats_sinks import attach_stats_sinks
from tests.helpers import tiny_cfg

wandb_sink = pytest.importorskip("pycls_fast.observe.wandb_sink")
pytest.importorskip("wandb")


def _records(epoch, iters=4):
    for it in (2, 4):
        yield {"_type": "train_iter", "epoch": f"{epoch}/2",
               "iter": f"{it}/{iters}", "loss": 1.0 / (epoch * it), "mfu": 0.25,
               "grad_norm": 0.5 * it}  # fmt: skip
    yield {"_type": "train_epoch", "epoch": f"{epoch}/2", "loss": 1.0 / epoch,
           "goodput": 0.8, "wall_lost_s": 0.0}  # fmt: skip
    yield {"_type": "test_epoch", "epoch": f"{epoch}/2", "top1_err": 50.0 / epoch,
           "loss": 2.0 / epoch}  # fmt: skip


def _one_start(out_dir, cfg, epochs):
    setup_logging(str(out_dir), "file", True)
    attach_stats_sinks(str(out_dir), wandb_cfg=cfg)
    for epoch in epochs:
        for record in _records(epoch):
            log_json_stats(record)
    if epochs[-1] == 2:  # the run's end
        log_json_stats({"_type": "goodput", "epoch": "2/2", "goodput": 0.75})
    setup_logging(str(out_dir), "file", True)  # closes the sinks: the run finishes


def _finished(path, timeout=60.0):
    """The records of a run's file once W&B's service has written its exit record
    (the service process writes the file after `finish()` returns)."""
    deadline = time.monotonic() + timeout
    while True:
        records = wandb_sink.read_run_file(path)
        if any(r["kind"] == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.2)


def _history(path):
    return [r["items"] for r in _finished(path) if r["kind"] == "history"]


def test_records_config_and_resume_in_one_wandb_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = tiny_cfg("OUT_DIR", str(tmp_path), "LOG_WANDB", "True",
                   "WANDB.TAGS", "['tiny']")  # fmt: skip
    _one_start(tmp_path, cfg, [1])
    _one_start(tmp_path, cfg, [2])  # a resumed run: the same OUT_DIR
    logging.getLogger().handlers.clear()
    files = wandb_sink.run_files(str(tmp_path))
    assert len(files) == 2
    run_id = (tmp_path / "wandb_id").read_text().strip()
    for path in files:
        runs = [r for r in _finished(path) if r["kind"] == "run"]
        assert runs and runs[0]["run_id"] == run_id
    first, second = _history(files[0]), _history(files[1])
    iters = [h["iteration"] for h in first + second if "train_iter/loss" in h]
    assert iters == [2, 4, 6, 8]  # global iterations, across the two starts
    losses = [h["train_iter/loss"] for h in first + second if "train_iter/loss" in h]
    assert losses == [0.5, 0.25, 0.25, 0.125]
    epochs = [(h["epoch"], h["test_epoch/top1_err"]) for h in first + second
              if "test_epoch/top1_err" in h]  # fmt: skip
    assert epochs == [(1, 50.0), (2, 25.0)]
    assert all(h["train_iter/mfu"] == 0.25 for h in first if "train_iter/mfu" in h)
    config = runs[0]["config"]
    assert config["TRAIN"]["IM_SIZE"] == 32 and config["WANDB"]["TAGS"] == ["tiny"]
    # The run's end: the curves as an image, the final figures in the summary.
    assert any(h.get("plots/curves/_type") == "image-file" for h in second)
    summary = {}
    for r in wandb_sink.read_run_file(files[1]):
        if r["kind"] == "summary":
            summary.update(r["items"])
    assert summary["final/test_epoch/top1_err"] == 25.0
    assert summary["final/goodput/goodput"] == 0.75
