"""LOG_WANDB: every stats record to a Weights & Biases run (main process only).

    attach_stats_sinks(out_dir, wandb_cfg=cfg)   # stats_sinks.py adds WandbStats
    read_run_file(path)                          # the records of a .wandb file

The run gets the resolved config; each json_stats record is logged as
`<type>/<field>` (the TensorBoard names), train_iter records against `iteration`
(the global iteration), the epoch records and the goodput account against `epoch`;
the run's end (its `goodput` record) adds the curves of OUT_DIR/stdout.log as an
image (`plots/curves`, observe/plots.py) and the final figures to the run's summary
(`final/...`). The run's id is written to OUT_DIR/wandb_id on its first start and
read on every later one, so that a resumed or requeued run continues the same W&B
run (`resume="allow"`). Files go to OUT_DIR/wandb/; in offline mode
(WANDB.MODE offline or WANDB_MODE=offline) nothing leaves the machine, and
`wandb sync OUT_DIR/wandb/offline-run-*` uploads the run later.

`read_run_file` reads a run's transaction log (`run-<id>.wandb`) back with wandb's
own record schema (wandb.proto.wandb_internal_pb2.Record); the file is LevelDB's
log format behind a 7-byte W&B header, which the current wandb reads in its Go core
only: tests and users check an offline run with it, without a server.
"""

import json
import logging
import os
import struct
import uuid

from yacs.config import CfgNode

from pycls_fast.errors import UserError
from pycls_fast.observe.stats_handler import StatsHandler, fraction

ID_FILE = "wandb_id"
EPOCH_TYPES = ("train_epoch", "test_epoch", "test_ema_epoch", "goodput")
logger = logging.getLogger(__name__)


def run_id(out_dir: str) -> str:
    """The W&B run id of OUT_DIR: read from OUT_DIR/wandb_id, or made and written
    there on the first start."""
    path = os.path.join(out_dir, ID_FILE)
    if os.path.isfile(path):
        with open(path) as f:
            found = f.read().strip()
        if found:
            return found
    new = uuid.uuid4().hex[:8]  # W&B's own ids: 8 lowercase letters and digits
    with open(path, "w") as f:
        f.write(new + "\n")
    return new


class WandbStats(StatsHandler):
    """The W&B run of OUT_DIR: every record's numeric fields as its history."""

    def __init__(self, out_dir: str, cfg: CfgNode) -> None:
        super().__init__()
        try:
            import wandb
        except ImportError:
            raise UserError(
                "LOG_WANDB needs the wandb package: pip install wandb (or pip "
                "install -e .[wandb])"
            ) from None
        self.out_dir = out_dir
        node = cfg.WANDB
        self.run = wandb.init(
            project=node.PROJECT,
            entity=node.ENTITY or None,
            name=node.NAME or os.path.basename(os.path.abspath(out_dir)),
            tags=list(node.TAGS),
            mode=os.environ.get("WANDB_MODE") or node.MODE,
            dir=out_dir,
            id=run_id(out_dir),
            resume="allow",
            config=_plain(cfg),
            # The console stays ours (tqdm, the human lines); stdout.log has it all.
            settings=wandb.Settings(console="off"),
        )
        self.run.define_metric("iteration")
        self.run.define_metric("epoch")
        self.run.define_metric("train_iter/*", step_metric="iteration")
        for kind in EPOCH_TYPES:
            self.run.define_metric(f"{kind}/*", step_metric="epoch")
        self.final: dict[str, float] = {}

    def take(self, stats: dict) -> None:
        kind = stats.get("_type", "stats")
        epoch = fraction(stats.get("epoch"))
        if epoch is None:
            return
        data = {
            f"{kind}/{key}": value
            for key, value in stats.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool)
        }
        it = fraction(stats.get("iter"))
        if "global_iter" in stats:  # epochs of a TRAIN.SIZE_SCHEDULE differ
            data["iteration"] = int(stats["global_iter"])
        elif it is not None:
            data["iteration"] = (epoch[0] - 1) * it[1] + it[0]
        else:
            data["epoch"] = epoch[0]
        if kind in ("test_epoch", "test_ema_epoch", "goodput"):
            self.final.update({f"final/{k}": v for k, v in data.items() if "/" in k})
        self.run.log(data)
        if kind == "goodput":
            self._end_of_run()

    def _end_of_run(self) -> None:
        """The curves as an image and the final figures in the summary."""
        import wandb

        self.run.summary.update(self.final)
        try:
            from pycls_fast.observe.plots import plot_runs, read_run

            png = os.path.join(self.out_dir, "plots.png")
            plot_runs([read_run(self.out_dir)], png)
            self.run.log({"plots/curves": wandb.Image(png)})
        except UserError:
            pass  # no epoch ended yet: nothing to draw

    def close(self) -> None:
        try:
            if getattr(self, "run", None) is not None:
                self.run.finish()
        finally:
            super().close()


def _plain(cfg: CfgNode) -> dict:
    """The config as plain nested dicts (W&B's config panel)."""
    return {k: _plain(v) if isinstance(v, CfgNode) else v for k, v in cfg.items()}


# The LevelDB log format: 32 KiB blocks of chunks, each with a 7-byte header
# (crc32c, length, type: 1 full, 2 first, 3 middle, 4 last).
_BLOCK = 32768
_HEADER = 7
_W_AND_B = b":W&B"


def _chunks(data: bytes):
    pos, record = _HEADER, b""
    if not data.startswith(_W_AND_B):
        raise ValueError("not a W&B transaction log")
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # the block's trailer: zero padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + _HEADER])
        pos += _HEADER
        piece = data[pos : pos + length]
        pos += length
        if kind == 0 and length == 0:
            continue
        record += piece
        if kind in (1, 4):
            yield record
            record = b""


def read_run_file(path: str) -> list[dict]:
    """The records of a W&B transaction log `path` (`run-<id>.wandb`), in order, as
    {"kind": ..., ...}: "history" records have "items" {key: value}; "config" and
    "summary" their updated items; "run" its "run_id" and "config"; others only
    their kind."""
    from wandb.proto import wandb_internal_pb2 as pb

    with open(path, "rb") as f:
        data = f.read()
    out = []
    for raw in _chunks(data):
        rec = pb.Record()
        rec.ParseFromString(raw)
        kind = rec.WhichOneof("record_type")
        entry = {"kind": kind}
        if kind == "history":
            entry["items"] = {
                i.key or "/".join(i.nested_key): json.loads(i.value_json)
                for i in rec.history.item
            }
        elif kind in ("config", "summary"):
            entry["items"] = {
                i.key or "/".join(i.nested_key): json.loads(i.value_json)
                for i in getattr(rec, kind).update
            }
        elif kind == "run":
            entry["run_id"] = rec.run.run_id
            entry["config"] = {
                i.key: json.loads(i.value_json) for i in rec.run.config.update
            }
        out.append(entry)
    return out


def run_files(out_dir: str) -> list[str]:
    """The transaction logs of OUT_DIR's W&B run, oldest first (one per start)."""
    root = os.path.join(out_dir, "wandb")
    found = []
    if os.path.isdir(root):
        for name in sorted(os.listdir(root)):
            folder = os.path.join(root, name)
            if name.startswith(("offline-run-", "run-")) and os.path.isdir(folder):
                found += [
                    os.path.join(folder, f)
                    for f in sorted(os.listdir(folder))
                    if f.endswith(".wandb")
                ]
    return found
