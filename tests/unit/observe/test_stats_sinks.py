"""OUT_DIR/epoch_stats.csv and TensorBoard scalars hold the json_stats records."""

import csv
import glob
import os

import pytest
import torch

from pycls_fast.engine.trainer import train_model
from pycls_fast.observe.logging import load_json_stats
from pycls_fast.observe.stats_sinks import CSV_COLUMNS, EPOCH_TYPES
from tests.helpers import EXACT, JSON_REL, digits_cfg

# A TensorBoard scalar is the record's float rounded to float32 (u relative); the
# logged json_stats figure, to 6 significant digits (JSON_REL).
LOGGED_REL = JSON_REL + torch.finfo(torch.float32).eps / 2


def _cfg(digits, out_dir, *opts):
    return digits_cfg(
        digits, out_dir, "VIT.NUM_LAYERS", "1", "OPTIM.MAX_EPOCH", "2",
        "LOG_PERIOD", "4", "OPTIM.EMA_ALPHA", "1e-4", *opts,
    )  # fmt: skip


def _csv_rows(out_dir):
    with open(os.path.join(out_dir, "epoch_stats.csv"), newline="") as f:
        return list(csv.DictReader(f))


def _same(row, record):
    # The record's "E/MAX" is two numbers in the CSV.
    epoch, max_epoch = record["epoch"].split("/")
    assert (row["epoch"], row["max_epoch"]) == (epoch, max_epoch)
    for key in CSV_COLUMNS:
        if key in record and key != "epoch":
            want = record[key]
            got = row[key]
            if isinstance(want, float):
                assert float(got) == pytest.approx(want, rel=EXACT["rtol"]), key
            else:
                assert got == str(want), key


def test_tensorboard_scalars_and_csv_rows_equal_the_json_stats(digits, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import (
        EventAccumulator,
    )

    train_model(_cfg(digits, tmp_path, "LOG_TENSORBOARD", "True"))
    records = load_json_stats(tmp_path / "stdout.log")
    epochs = [r for r in records if r["_type"] in EPOCH_TYPES]
    assert len(epochs) == 6  # train, test, test EMA x 2 epochs
    rows = _csv_rows(tmp_path)
    assert [(r["_type"], r["epoch"]) for r in rows] == [
        (r["_type"], r["epoch"].split("/")[0]) for r in epochs
    ]
    for row, record in zip(rows, epochs):
        _same(row, record)

    (events,) = glob.glob(str(tmp_path / "tb_log" / "events.out.tfevents.*"))
    acc = EventAccumulator(events)
    acc.Reload()
    tags = acc.Tags()["scalars"]
    for kind in ("train_iter", "train_epoch", "test_epoch", "test_ema_epoch"):
        assert f"{kind}/loss" in tags and f"{kind}/top1_err" in tags
    assert "train_iter/lr" in tags and "train_epoch/img_per_s" in tags
    iters = [r for r in records if r["_type"] == "train_iter"]
    steps_per_epoch = int(iters[0]["iter"].split("/")[1])
    logged = {
        (int(r["epoch"].split("/")[0]) - 1) * steps_per_epoch
        + int(r["iter"].split("/")[0]): r["loss"]
        for r in iters
    }
    scalars = {e.step: e.value for e in acc.Scalars("train_iter/loss")}
    assert scalars.keys() == logged.keys()
    for step, value in logged.items():
        assert scalars[step] == pytest.approx(value, rel=LOGGED_REL)
    tests = {int(r["epoch"].split("/")[0]): r["top1_err"] for r in records
             if r["_type"] == "test_epoch"}  # fmt: skip
    got = {e.step: e.value for e in acc.Scalars("test_epoch/top1_err")}
    assert got.keys() == tests.keys()
    assert all(got[k] == pytest.approx(v, rel=LOGGED_REL) for k, v in tests.items())


def test_a_resumed_run_does_not_duplicate_csv_rows(digits, tmp_path):
    every_epoch = ["TRAIN.CHECKPOINT_PERIOD", "1"]
    train_model(_cfg(digits, tmp_path, *every_epoch))
    first = _csv_rows(tmp_path)
    # The last epoch again (its checkpoint removed, as after a crash before it), at
    # another learning rate: the rerun's rows differ from the first run's.
    os.remove(tmp_path / "checkpoints" / "model_epoch_0002.pyth")
    train_model(_cfg(digits, tmp_path, *every_epoch, "OPTIM.BASE_LR", "0.03"))
    again = _csv_rows(tmp_path)
    assert [(r["_type"], r["epoch"]) for r in again] == [
        (r["_type"], r["epoch"]) for r in first
    ]
    # Epoch 1's rows are the first run's, untouched; epoch 2's are the rerun's
    # (the last epoch records of the log, which both runs append to).
    assert again[:3] == first[:3]
    records = load_json_stats(tmp_path / "stdout.log")
    for row in again[3:]:
        rerun = [r for r in records if r["_type"] == row["_type"]][-1]
        _same(row, rerun)
    assert again[3]["loss"] != first[3]["loss"]  # so the rows above were rewritten
    with open(tmp_path / "stdout.log") as f:
        assert "resumed from" in f.read()  # at epoch 2, not rerun from the start


def test_csv_epochs_are_numbers_also_in_a_file_from_before(tmp_path):
    """A record's "2/4" is epoch 2 of max_epoch 4; rows of a file written with the
    "2/4" strings (an older version) are read as numbers, and replaced by key."""
    from pycls_fast.observe.stats_sinks import CsvEpochStats

    path = tmp_path / "epoch_stats.csv"
    path.write_text("_type,epoch,loss\ntrain_epoch,1/4,2.5\ntrain_epoch,2/4,2.0\n")
    sink = CsvEpochStats(str(tmp_path))
    sink.take({"_type": "train_epoch", "epoch": "2/4", "loss": 1.5})
    rows = _csv_rows(tmp_path)
    assert [(r["epoch"], r["max_epoch"], r["loss"]) for r in rows] == [
        ("1", "4", "2.5"),
        ("2", "4", "1.5"),
    ]
