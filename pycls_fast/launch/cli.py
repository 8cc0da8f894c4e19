"""Shared command-line handling for tools/: config arguments and exit codes.

Exit status: 0 on success, 2 for a user mistake (bad argument, bad config, missing
file), 1 for a runtime failure. Errors are one line on stderr naming what is wrong.
"""

import argparse
import os
import sys
from collections.abc import Callable

from pycls_fast.checkpoint.files import resolve_weights
from pycls_fast.checkpoint.retention import best_checkpoint
from pycls_fast.config import load_cfg, with_overrides
from pycls_fast.errors import UserError, error_line, exit_code
from pycls_fast.launch.processes import exit_process, under_torchrun

# Where `--run OUT_DIR` evaluations write their log: beside, not over, the run's.
EVAL_DIR = "eval"


def config_parser(
    description: str, *, several: bool = False, run: bool = False, best: bool = False
) -> argparse.ArgumentParser:
    """Returns an ArgumentParser with pycls's `--cfg FILE [KEY VALUE ...]` arguments
    (`several`: --cfg may be given more than once, `args.cfg_file` is then a list).
    `run`: `--run OUT_DIR` takes the config of a finished run (--cfg is then
    optional); `best`: also `--best`, and the run's checkpoint is evaluated."""
    parser = argparse.ArgumentParser(
        description=description,
        epilog="KEY VALUE (or KEY=VALUE) pairs override config keys, e.g. "
        "OPTIM.BASE_LR 0.001 (see docs/CONFIG.md).",
    )
    if several:
        parser.add_argument(
            "--cfg", dest="cfg_file", required=not run, action="append",
            help="config file (repeat --cfg for several)",
        )  # fmt: skip
    else:
        parser.add_argument(
            "--cfg", dest="cfg_file", required=not run, help="config file"
        )
    if run:
        parser.add_argument(
            "--run", metavar="OUT_DIR",
            help="a run's folder: its config.yaml is the config"
            + (" and its newest complete checkpoint the weights" if best else ""),
        )  # fmt: skip
    if best:
        parser.add_argument(
            "--best", action="store_true",
            help="with --run: the best checkpoint (checkpoints/best.json)",
        )  # fmt: skip
    parser.add_argument(
        "opts", nargs="*", help="config overrides: KEY VALUE or KEY=VALUE ..."
    )
    parser.parse_args = parser.parse_intermixed_args  # options may follow KEY VALUE
    return parser


def require_config(args) -> None:
    """UserError when neither --cfg nor --run names a config."""
    if not (args.cfg_file or getattr(args, "run", None)):
        raise UserError("give --cfg FILE or --run OUT_DIR")


def run_config_file(run_dir: str) -> str:
    """OUT_DIR/config.yaml of a run; UserError when the run has none."""
    path = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(path):
        what = "folder not found" if not os.path.isdir(run_dir) else "no config.yaml in"
        raise UserError(f"--run: {what} {run_dir} (a train_net.py OUT_DIR)")
    return path


def run_opts(args) -> list:
    """The overrides that `--run OUT_DIR` puts before the user's: the run's
    checkpoint as TEST.WEIGHTS (the best with --best) and OUT_DIR/eval as OUT_DIR,
    so that an evaluation never writes over the run's own stdout.log."""
    if getattr(args, "best", False):
        if not args.run:
            raise UserError("--best needs --run OUT_DIR")
        weights = best_checkpoint(args.run)
    else:
        weights = resolve_weights(args.run)[0]
    return ["OUT_DIR", os.path.join(args.run, EVAL_DIR), "TEST.WEIGHTS", weights]


def cfg_from_args(args):
    """Loads and checks the config named by parsed `args` (raises ConfigError), at
    the launcher's world size under torchrun (it replaces NUM_GPUS); with `--run
    OUT_DIR`, the run's config.yaml (unless --cfg is given) and, for tools made
    with `best=True`, its checkpoint; KEY VALUE overrides apply last."""
    run_dir = getattr(args, "run", None)
    require_config(args)
    if not run_dir:
        if getattr(args, "best", False):
            raise UserError("--best needs --run OUT_DIR")
        return load_cfg(args.cfg_file, args.opts or [], launcher_world_size())
    path = args.cfg_file or run_config_file(run_dir)
    before = run_opts(args) if hasattr(args, "best") else []
    return load_cfg(path, before + list(args.opts or []), launcher_world_size())


def launcher_world_size() -> int | None:
    """torchrun's (or SLURM's torchrun-like) WORLD_SIZE when a launcher started this
    process, else None: the config's NUM_GPUS then says how many to start."""
    return int(os.environ["WORLD_SIZE"]) if under_torchrun() else None


def is_training_run(out_dir: str) -> bool:
    """Whether `out_dir` holds a training run's records (its config.yaml or
    checkpoints/), which evaluations must not write into."""
    return os.path.isfile(os.path.join(out_dir, "config.yaml")) or os.path.isdir(
        os.path.join(out_dir, "checkpoints")
    )


def evaluation_out_dir(cfg):
    """`cfg` with OUT_DIR made OUT_DIR/eval when OUT_DIR holds a training run (as
    `--run` does), said on stdout: an evaluation never appends to the run's
    stdout.log nor rewrites its epoch_stats.csv."""
    if not is_training_run(cfg.OUT_DIR):
        return cfg
    out = os.path.join(cfg.OUT_DIR, EVAL_DIR)
    print(f"OUT_DIR {cfg.OUT_DIR} holds a training run: this evaluation logs to {out}")
    return with_overrides(cfg, {"OUT_DIR": out})


def run(main: Callable[[], int | None]) -> None:
    """Runs `main()` and ends the process: 0, or the failure's one line on stderr
    and its exit status (errors.exit_code maps it by type)."""
    try:
        code = main() or 0
    except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001 - the tools' last line
        print(error_line(e), file=sys.stderr)
        code = exit_code(e)
    exit_process(code)
