"""Shared command-line handling for tools/: config arguments and exit codes.

Exit status: 0 on success, 2 for a user mistake (bad argument, bad config, missing
file), 1 for a runtime failure. Errors are one line on stderr naming what is wrong.
"""

import argparse
import sys
from collections.abc import Callable

from pycls_fast.config import load_cfg
from pycls_fast.core.launch import exit_process
from pycls_fast.errors import error_line, exit_code


def config_parser(
    description: str, *, several: bool = False
) -> argparse.ArgumentParser:
    """Returns an ArgumentParser with pycls's `--cfg FILE [KEY VALUE ...]` arguments
    (`several`: --cfg may be given more than once, `args.cfg_file` is then a list)."""
    parser = argparse.ArgumentParser(
        description=description,
        epilog="KEY VALUE (or KEY=VALUE) pairs override config keys, e.g. "
        "OPTIM.BASE_LR 0.001 (see docs/CONFIG.md).",
    )
    if several:
        parser.add_argument(
            "--cfg", dest="cfg_file", required=True, action="append",
            help="config file (repeat --cfg for several)",
        )  # fmt: skip
    else:
        parser.add_argument("--cfg", dest="cfg_file", required=True, help="config file")
    parser.add_argument(
        "opts", nargs="*", help="config overrides: KEY VALUE or KEY=VALUE ..."
    )
    parser.parse_args = parser.parse_intermixed_args  # options may follow KEY VALUE
    return parser


def cfg_from_args(args):
    """Loads and checks the config named by parsed `args` (raises ConfigError)."""
    return load_cfg(args.cfg_file, args.opts or [])


def run(main: Callable[[], int | None]) -> None:
    """Runs `main()` and ends the process: 0, or the failure's one line on stderr
    and its exit status (errors.exit_code maps it by type)."""
    try:
        code = main() or 0
    except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001 - the tools' last line
        print(error_line(e), file=sys.stderr)
        code = exit_code(e)
    exit_process(code)
