"""Where stats records go besides the log: a CSV of epoch stats and TensorBoard.

    attach_stats_sinks(out_dir, tensorboard=True)   # main process, after setup_logging

Both are logging handlers on the root logger that take the records `log_json_stats`
logs (their `json_stats` values, rounded as the log line rounds them), so every record
reaches every sink once, from one place:

- OUT_DIR/epoch_stats.csv: one row per (record type, epoch) of the epoch records
  (train_epoch, test_epoch, test_ema_epoch), columns in a fixed order, the epoch a
  number (the record's "3/10" is `epoch` 3, `max_epoch` 10); a resumed run that
  logs an epoch again replaces its row instead of adding a second one.
  Train rows carry the throughput (tflops, mfu, ...), memory, gradient norm and
  goodput columns too (empty in test rows).
- OUT_DIR/tb_log/ (pycls's vitconfigs folder name), with `LOG_TENSORBOARD True`:
  every numeric field of every record as the scalar `<type>/<field>` (pycls's
  `train_iter/loss`, `test_epoch/top1_err`, ...), at the global iteration for
  iteration records and at the epoch for epoch records.
- a Weights & Biases run, with `LOG_WANDB True` (wandb_sink.py).
"""

import csv
import logging
import os

from yacs.config import CfgNode

from pycls_fast.errors import UserError
from pycls_fast.observe.stats_handler import StatsHandler, fraction

CSV_FILE = "epoch_stats.csv"
TB_DIR = "tb_log"
EPOCH_TYPES = ("train_epoch", "test_epoch", "test_ema_epoch")
CSV_COLUMNS = [
    "_type", "epoch", "max_epoch", "loss", "top1_err", "top5_err", "lr", "img_per_s",
    "images", "data_wait_frac", "bad_images", "skipped_steps", "loss_scale",
    "time_epoch_s",
    "mem_mb", "tflops", "hw_tflops", "mfu", "hfu", "grad_norm", "mem_reserved_mb",
    "alloc_retries", "oom_count", "host_rss_mb", "goodput", "wall_s",
    "wall_step_s", "wall_data_s", "wall_eval_s", "wall_checkpoint_s",
    "wall_startup_s", "wall_lost_s", "wall_other_s",
]  # fmt: skip


class CsvEpochStats(StatsHandler):
    """OUT_DIR/epoch_stats.csv: a row per (type, epoch) of the epoch records."""

    def __init__(self, out_dir: str) -> None:
        super().__init__()
        self.path = os.path.join(out_dir, CSV_FILE)
        self.rows: list[dict] = []
        if os.path.exists(self.path):
            with open(self.path, newline="") as f:
                self.rows = [_numeric_epoch(r) for r in csv.DictReader(f)]

    def take(self, stats: dict) -> None:
        if stats.get("_type") not in EPOCH_TYPES:
            return
        row = _numeric_epoch({c: stats.get(c, "") for c in CSV_COLUMNS})
        key = (str(row["_type"]), str(row["epoch"]))
        kept = [r for r in self.rows if (r["_type"], str(r["epoch"])) != key]
        self.rows = kept + [row]
        tmp = self.path + ".tmp"
        with open(tmp, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(self.rows)
        os.replace(tmp, self.path)


def _numeric_epoch(row: dict) -> dict:
    """`row` with a record's "E/MAX" epoch as `epoch` E and `max_epoch` MAX (rows of
    a file written before the column existed too); other values as they are."""
    found = fraction(row.get("epoch"))
    if found is not None:
        row = {**row, "epoch": found[0], "max_epoch": found[1]}
    return row


class TensorBoardStats(StatsHandler):
    """OUT_DIR/tb_log: every numeric field of every record as a scalar."""

    def __init__(self, out_dir: str) -> None:
        super().__init__()
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise UserError(
                "LOG_TENSORBOARD needs the tensorboard package: pip install "
                "tensorboard (or pip install -e .[tensorboard])"
            ) from None
        self.writer = SummaryWriter(os.path.join(out_dir, TB_DIR))

    @staticmethod
    def step(stats: dict) -> int | None:
        """The x of a record: its global iteration (iteration records) or epoch."""
        epoch = fraction(stats.get("epoch"))
        if epoch is None:
            return None
        if "global_iter" in stats:  # epochs of a TRAIN.SIZE_SCHEDULE differ
            return int(stats["global_iter"])
        it = fraction(stats.get("iter"))
        if it is not None:
            return (epoch[0] - 1) * it[1] + it[0]
        return epoch[0]

    def take(self, stats: dict) -> None:
        kind, step = stats.get("_type", "stats"), self.step(stats)
        if step is None:
            return
        for key, value in stats.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(f"{kind}/{key}", value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
        super().close()


def attach_stats_sinks(
    out_dir: str, tensorboard: bool = False, wandb_cfg: CfgNode | None = None
) -> None:
    """Adds the CSV (with `tensorboard`, the TensorBoard; with `wandb_cfg`, the
    config of a LOG_WANDB run, the W&B) sink to the root logger (setup_logging
    removes them with the other handlers)."""
    root = logging.getLogger()
    root.addHandler(CsvEpochStats(out_dir))
    if tensorboard:
        root.addHandler(TensorBoardStats(out_dir))
    if wandb_cfg is not None:
        # Imported here: wandb is imported only when a run asks for it.
        from pycls_fast.observe.wandb_sink import WandbStats

        root.addHandler(WandbStats(out_dir, wandb_cfg))
