"""console.human_line and ConsoleFormatter: the terminal's view of stats records."""

import logging

from pycls_fast.observe.console import ConsoleFormatter, human_line
from pycls_fast.observe.logging import dump_json_stats

ITER = {
    "_type": "train_iter", "epoch": "2/60", "iter": "40/500", "loss": 1.52216,
    "top1_err": 35.5, "top5_err": 12.0, "img_per_s": 2345.6,
    "data_wait_frac": 0.123, "eta": "01:02:03", "lr": 1e-3,
}  # fmt: skip


def test_human_lines():
    assert human_line(ITER) == (
        "train epoch 2/60 iter 40/500  loss 1.5222  top-1 64.50%  2,346 img/s  "
        "data wait 12%  ETA 01:02:03"
    )
    test = {"_type": "test_ema_epoch", "epoch": "2/60", "loss": 0.5, "top1_err": 10.0,
            "top5_err": 1.0, "img_per_s": 900.0, "time_epoch_s": 3.21}  # fmt: skip
    assert human_line(test) == (
        "test EMA epoch 2/60  loss 0.5000  top-1 90.00%  top-5 99.00%  900 img/s  3.2 s"
    )
    assert human_line({"_type": "time_net"}) is None


def test_formatter_leaves_the_record_for_the_file():
    record = logging.LogRecord("x", logging.INFO, "f.py", 1, dump_json_stats(ITER),
                               (), None)  # fmt: skip
    record.stats = ITER
    assert ConsoleFormatter("%(message)s").format(record) == human_line(ITER)
    assert logging.Formatter("%(message)s").format(record).startswith("json_stats: ")
