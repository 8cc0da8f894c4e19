"""Shared command-line handling for tools/: config arguments and exit codes.

Exit status: 0 on success, 2 for a user mistake (bad argument, bad config, missing
file), 1 for a runtime failure. Errors are one line on stderr naming what is wrong.
"""

import argparse
import difflib
import os
import sys
import traceback
from collections.abc import Callable
from typing import NoReturn

from pycls_fast.checkpoint.files import resolve_weights
from pycls_fast.checkpoint.retention import best_checkpoint
from pycls_fast.config import load_cfg, with_overrides
from pycls_fast.errors import PyclsFastError, UserError, error_line, exit_code
from pycls_fast.launch.processes import exit_process, under_torchrun
from pycls_fast.models.timm_names import timm_config, timm_names

# timm's train.py flags, and the config key each means here.
TIMM_FLAGS = {
    "--lr": "OPTIM.BASE_LR (used as given: never scaled by the batch size or NUM_GPUS)",
    "--epochs": "OPTIM.MAX_EPOCH",
    "--batch-size": "TRAIN.BATCH_SIZE (the batch of all processes together; "
    "timm's is per process)",
    "-b": "TRAIN.BATCH_SIZE (the batch of all processes together; timm's is per "
    "process)",
    "--model": "--cfg (a config file, or a timm name: vit_small_patch16_224 is "
    "configs/vit/ViT-S-16.yaml with timm's head)",
    "--amp": "AMP.MODE O1 (autocast; AMP.DTYPE bf16 or fp16)",
    "--warmup-epochs": "OPTIM.WARMUP_EPOCHS",
    "--weight-decay": "OPTIM.WEIGHT_DECAY",
    "--opt": "OPTIM.OPTIMIZER",
    "--data-dir": "DATA.PATH",
    "--output": "OUT_DIR",
    "--img-size": "TRAIN.IM_SIZE",
    "--num-classes": "MODEL.NUM_CLASSES",
    "--mixup": "TRAIN.MIXUP_ALPHA",
    "--cutmix": "TRAIN.CUTMIX_ALPHA",
    "--smoothing": "TRAIN.LABEL_SMOOTHING",
    "--drop-path": "VIT.DROP_PATH",
    "--aa": "TRAIN.AUGMENT (timm's strings as they are: rand-m9-mstd0.5-inc1)",
    "--reprob": "TRAIN.RANDOM_ERASE",
    "--seed": "RNG_SEED",
    "--workers": "DATA_LOADER.NUM_WORKERS",
    "-j": "DATA_LOADER.NUM_WORKERS",
    "--resume": "TRAIN.AUTO_RESUME (a rerun into OUT_DIR resumes its newest "
    "checkpoint)",
    "--checkpoint": "TEST.WEIGHTS",
    "--model-ema": "OPTIM.EMA_ALPHA",
}


# Other trainers' flags (pycls forks, detectron2, Swin, mmcv) and what they are here.
# None: the flag that takes config overrides, which here need no flag.
OTHER_FLAGS = {
    "--opts": None,
    "--cfg-options": None,
    "--config": "--cfg",
    "--config-file": "--cfg",
    "--out-dir": "OUT_DIR",
    "--output-dir": "OUT_DIR",
    "--work-dir": "OUT_DIR",
}


def _flag_value(argv: list[str], i: int, value: str, eq: str) -> str:
    """The value given to the flag argv[i] (`--flag=value` or `--flag value`)."""
    if not eq and i + 1 < len(argv) and not argv[i + 1].startswith("-"):
        return argv[i + 1]
    return value


def _overrides_after(argv: list[str], i: int, value: str) -> str:
    """The KEY VALUE words that follow the flag argv[i], up to the next flag."""
    words = [value] if value else []
    for word in argv[i + 1 :]:
        if word.startswith("--"):
            break
        words.append(word)
    return " ".join(words)


def check_flag_habits(argv: list[str], own=()) -> None:
    """UserError, in one line naming what to give instead, for the first flag in
    `argv` of another trainer's habits that is not one of the tool's `own`: timm's
    (`--lr 0.01`: `OPTIM.BASE_LR 0.01`), `--opts KEY VALUE` (the overrides bare),
    `--config FILE` (`--cfg FILE`), `--out-dir DIR` (`OUT_DIR DIR`)."""
    for i, arg in enumerate(argv):
        if arg == "--":
            return
        flag, eq, value = arg.partition("=")
        if flag in own or (flag not in TIMM_FLAGS and flag not in OTHER_FLAGS):
            continue
        if flag in OTHER_FLAGS and OTHER_FLAGS[flag] is None:
            given = _overrides_after(argv, i, value)
            example = f": {given}" if given else ", e.g. OPTIM.MAX_EPOCH 1"
            raise UserError(
                f"{flag} is not needed here: config overrides go as bare KEY VALUE "
                f"pairs after the flags{example}"
            )
        value = _flag_value(argv, i, value, eq)
        if flag in OTHER_FLAGS:
            key = OTHER_FLAGS[flag]
            what = "--cfg FILE" if key == "--cfg" else f"the config key {key}"
            example = f": {key} {value}" if value else ""
            raise UserError(f"{flag} is not a flag here; it is {what}{example}")
        key = TIMM_FLAGS[flag]
        what = key if key.startswith("-") else f"the config key {key}"
        example = f": {key.split(' ')[0]} {value}" if value else ""
        raise UserError(f"{flag} is timm's flag; here it is {what}{example}")


class ArgumentParser(argparse.ArgumentParser):
    """argparse with the project's errors: a mistake in the arguments is a UserError,
    one line (`error: ...`, exit status 2 through `run`), instead of argparse's usage
    and message; `--help` prints the full usage as before.

    `overrides`: the tool takes KEY VALUE config overrides, and other trainers'
    flags (timm's `--lr`, `--opts`) are refused naming what to give instead;
    `intermixed`: options may follow the KEY VALUE pairs."""

    def __init__(self, *args, overrides=False, intermixed=False, **kwargs):
        super().__init__(*args, **kwargs)
        self.overrides = overrides
        self.intermixed = intermixed

    def parse_args(self, args=None, namespace=None):
        if self.overrides:
            argv = sys.argv[1:] if args is None else list(args)
            check_flag_habits(argv, self._option_string_actions)
        if self.intermixed:
            return self.parse_intermixed_args(args, namespace)
        return super().parse_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        raise UserError(f"{message} (see {self.prog} --help)")


# Where `--run OUT_DIR` evaluations write their log: beside, not over, the run's.
EVAL_DIR = "eval"


def config_parser(
    description: str, *, several: bool = False, run: bool = False, best: bool = False
) -> argparse.ArgumentParser:
    """Returns an ArgumentParser with pycls's `--cfg FILE [KEY VALUE ...]` arguments
    (`several`: --cfg may be given more than once, `args.cfg_file` is then a list).
    `run`: `--run OUT_DIR` takes the config of a finished run (--cfg is then
    optional); `best`: also `--best`, and the run's checkpoint is evaluated."""
    parser = ArgumentParser(
        description=description,
        epilog="KEY VALUE (or KEY=VALUE) pairs override config keys, e.g. "
        "OPTIM.BASE_LR 0.001 (see docs/CONFIG.md).",
        overrides=True,
        intermixed=True,  # options may follow KEY VALUE
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
    return parser


def require_config(args) -> None:
    """UserError when neither --cfg nor --run names a config."""
    if not (args.cfg_file or getattr(args, "run", None)):
        raise UserError("give --cfg FILE or --run OUT_DIR")


def cfg_file_and_opts(cfg_file, opts: list) -> tuple:
    """(--cfg, overrides), a timm model name (vit_small_patch16_224) made its
    config file and overrides (models/timm_names.py), said on stdout."""
    if isinstance(cfg_file, str) and not os.path.exists(cfg_file):
        found = timm_config(cfg_file)
        if found is not None:
            path, overrides = found
            shown = os.path.relpath(path)
            print(f"--cfg {cfg_file}: {shown} {' '.join(overrides)}", flush=True)
            return path, overrides + list(opts)
        if cfg_file.startswith("vit_") and not cfg_file.endswith((".yaml", ".yml")):
            close = difflib.get_close_matches(cfg_file, timm_names(), n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            raise UserError(
                f"--cfg {cfg_file}: no such config file, nor a timm ViT name known "
                f"here ({hint}known: {', '.join(timm_names())}, at any image size)"
            )
    return cfg_file, opts


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
        path, opts = cfg_file_and_opts(args.cfg_file, args.opts or [])
        return load_cfg(path, opts, launcher_world_size())
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


def without_wandb(cfg):
    """An evaluation's `cfg`: LOG_WANDB off, said on stdout. W&B is the training
    run's dashboard; an evaluation keeps its records in its own OUT_DIR (stdout.log,
    the JSON report) and must not need W&B credentials (a colleague's machine, a
    cluster node), nor ask for a login."""
    if not cfg.LOG_WANDB:
        return cfg
    log = os.path.join(cfg.OUT_DIR, "stdout.log")
    print(f"LOG_WANDB: W&B skipped for this evaluation; its records are in {log}")
    return with_overrides(cfg, {"LOG_WANDB": False})


def run(main: Callable[[], int | None]) -> None:
    """Runs `main()` and ends the process: 0, or the failure's one line on stderr
    and its exit status (errors.exit_code maps it by type). An unexpected error (not
    pycls_fast's own: a bug to report) has its traceback above the line."""
    try:
        code = main() or 0
    except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001 - the tools' last line
        if not isinstance(e, PyclsFastError | KeyboardInterrupt):
            traceback.print_exc(file=sys.stderr)
        print(error_line(e), file=sys.stderr)
        code = exit_code(e)
    exit_process(code)
