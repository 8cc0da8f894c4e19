"""The terminal's view of the log: one short human line per stats record.

On a terminal, a ~300-character `json_stats:` line per log period is hard to read;
ConsoleFormatter shows the record as one line (epoch/iteration, loss, top-1
accuracy, images/s, data-wait share, MFU, gradient norm, goodput, ETA) instead.
OUT_DIR/stdout.log, and stdout when it is not a terminal (pipes, CI, SLURM logs),
keep the json_stats lines.
"""

import logging

from pycls_fast.observe.goodput import summary_line

# A record that log_json_stats logged carries its stats dict under this attribute.
STATS_ATTR = "stats"

_KIND = {
    "train_iter": "train",
    "train_epoch": "train",
    "test_epoch": "test",
    "test_ema_epoch": "test EMA",
}


def human_line(stats: dict) -> str | None:
    """A short line for a trainer stats record, or None for other records."""
    if stats.get("_type") == "goodput":
        return _goodput_line(stats)
    kind = _KIND.get(stats.get("_type"))
    if kind is None:
        return None
    where = f"epoch {stats.get('epoch', '?')}"
    if "iter" in stats:
        where += f" iter {stats['iter']}"
    parts = [f"{kind} {where}", f"loss {stats['loss']:.4f}"]
    parts.append(f"top-1 {100.0 - stats['top1_err']:.2f}%")
    if kind != "train":
        parts.append(f"top-5 {100.0 - stats['top5_err']:.2f}%")
    parts.append(f"{stats['img_per_s']:,.0f} img/s")
    if "data_wait_frac" in stats:
        parts.append(f"data wait {100.0 * stats['data_wait_frac']:.0f}%")
    if stats.get("mfu"):
        parts.append(f"MFU {100.0 * stats['mfu']:.1f}%")
    if "grad_norm" in stats:
        parts.append(f"|g| {stats['grad_norm']:.3g}")
    if "goodput" in stats:
        parts.append(f"goodput {100.0 * stats['goodput']:.0f}%")
    if "eta" in stats:
        parts.append(f"ETA {stats['eta']}")
    elif "time_epoch_s" in stats:
        parts.append(f"{stats['time_epoch_s']:.1f} s")
    return "  ".join(parts)


def _goodput_line(stats: dict) -> str:
    """The run's account of wall time, as `Goodput.summary` words it."""
    return summary_line(stats)


class ConsoleFormatter(logging.Formatter):
    """Formats stats records as human lines, everything else as given."""

    def format(self, record: logging.LogRecord) -> str:
        stats = getattr(record, STATS_ATTR, None)
        line = human_line(stats) if isinstance(stats, dict) else None
        if line is None:
            return super().format(record)
        # A copy: the file handler formats the same record as its json_stats line.
        human = logging.makeLogRecord(record.__dict__)
        human.msg, human.args = line, ()
        return super().format(human)
