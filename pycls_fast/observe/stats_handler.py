"""The base of the stats sinks: a logging handler that takes the stats records that
`log_json_stats` logs, as their json_stats line holds them.

    class MySink(StatsHandler):
        def take(self, stats: dict) -> None: ...
"""

import json
import logging

from pycls_fast.observe.console import STATS_ATTR
from pycls_fast.observe.logging import dump_json_stats


def logged(stats: dict) -> dict:
    """The record as its json_stats line holds it (floats to 6 significant digits)."""
    return json.loads(dump_json_stats(stats).split(": ", 1)[1])


def fraction(text) -> tuple[int, int] | None:
    """'3/10' -> (3, 10); None for anything else."""
    try:
        done, total = str(text).split("/")
        return int(done), int(total)
    except ValueError:
        return None


class StatsHandler(logging.Handler):
    """Passes the stats of json_stats records to `take(stats)`."""

    def emit(self, record: logging.LogRecord) -> None:
        stats = getattr(record, STATS_ATTR, None)
        if stats is None:
            return
        try:
            self.take(logged(stats))
        except Exception:  # noqa: BLE001 - logging must never raise
            self.handleError(record)

    def take(self, stats: dict) -> None:
        raise NotImplementedError
