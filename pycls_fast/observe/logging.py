"""Logging: a human log with ETA on stdout and in OUT_DIR/stdout.log, plus pycls's
`json_stats: {...}` lines that plotting and parsing tools read.

OUT_DIR/stdout.log always holds every stats record as a json_stats line, and so does
stdout when it is not a terminal (pipes, CI, SLURM logs). On a terminal, stdout shows
each record as one short human line instead (console.py), beside the tqdm bar.
Only the main process (rank 0) writes; other ranks log warnings and errors only.
"""

import json
import logging
import os
import sys

from pycls_fast.observe.console import STATS_ATTR, ConsoleFormatter

# A record logged with extra={FILE_ONLY: True} goes to OUT_DIR/stdout.log but not to
# the console: a line that the tool prints itself on exit (a stop's), not twice.
FILE_ONLY = "file_only"
_FORMAT = "[%(asctime)s][%(filename)s:%(lineno)d] %(message)s"
_CONSOLE_FORMAT = "[%(asctime)s] %(message)s"
_DATE = "%m/%d %H:%M:%S"
LOG_FILE = "stdout.log"
logger = logging.getLogger("pycls_fast")


def setup_logging(out_dir, log_dest="stdout", is_main=True):
    """Configures the root logger: stdout (if LOG_DEST is 'stdout') and
    OUT_DIR/stdout.log, appended to so that a resumed run keeps its history."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()
    root.setLevel(logging.INFO if is_main else logging.WARNING)
    formatter = logging.Formatter(_FORMAT, datefmt=_DATE)
    if log_dest == "stdout" or not is_main:
        on_terminal = is_main and sys.stdout.isatty()
        console = (
            _BarAwareHandler() if on_terminal else logging.StreamHandler(sys.stdout)
        )
        console.setFormatter(
            ConsoleFormatter(_CONSOLE_FORMAT, datefmt=_DATE)
            if on_terminal
            else formatter
        )
        console.addFilter(lambda record: not getattr(record, FILE_ONLY, False))
        root.addHandler(console)
    if is_main:
        os.makedirs(out_dir, exist_ok=True)
        file = logging.FileHandler(os.path.join(out_dir, LOG_FILE))
        file.setFormatter(formatter)
        root.addHandler(file)


class _BarAwareHandler(logging.StreamHandler):
    """Writes to a terminal through tqdm, which lifts the training's progress bar
    (also on stdout) for the line and redraws it below, instead of the line starting
    in the middle of the bar."""

    def __init__(self) -> None:
        super().__init__(sys.stdout)

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm

        try:
            tqdm.write(self.format(record), file=sys.stdout)
        except Exception:  # noqa: BLE001 - logging must never raise
            self.handleError(record)


def _json_value(v):
    if isinstance(v, float):
        return float(f"{v:.6g}")
    return v


def dump_json_stats(stats):
    """Returns the `json_stats: {...}` line for a stats record (pycls's format)."""
    stats = {k: _json_value(v) for k, v in stats.items()}
    return f"json_stats: {json.dumps(stats, sort_keys=True)}"


def log_json_stats(stats):
    """Logs a stats record as a json_stats line (a terminal shows a human line)."""
    logger.info(dump_json_stats(stats), extra={STATS_ATTR: stats}, stacklevel=2)


def load_json_stats(log_file):
    """Reads every json_stats record of a log file, in order."""
    records = []
    with open(log_file) as f:
        for line in f:
            if "json_stats: " in line:
                text = line.split("json_stats: ", 1)[1]
                try:
                    records.append(json.loads(text))
                except json.JSONDecodeError:
                    continue  # a line cut short by a crash
    return records


def last_per_epoch(records):
    """The epoch records (train_epoch, test_epoch, ...) with one per (_type, epoch):
    the last one logged, in epoch order. A run rerun from scratch, or resumed from an
    older checkpoint, logs some epochs again; its latest record of an epoch holds.
    (OUT_DIR/epoch_stats.csv keeps the same record per (type, epoch).)"""
    last = {}
    for r in records:
        last[(r.get("_type"), str(r.get("epoch")))] = r
    return sorted(last.values(), key=lambda r: _epoch_done(r.get("epoch")))


def _epoch_done(epoch):
    """pycls's '3/10' (or 3) as 3; 0 when it is neither."""
    try:
        return int(str(epoch).split("/")[0])
    except ValueError:
        return 0


def format_eta(seconds):
    """'1d 02:03:04' style time."""
    seconds = int(max(seconds, 0))
    days, rest = divmod(seconds, 86400)
    h, rest = divmod(rest, 3600)
    m, s = divmod(rest, 60)
    return f"{days}d {h:02d}:{m:02d}:{s:02d}" if days else f"{h:02d}:{m:02d}:{s:02d}"
