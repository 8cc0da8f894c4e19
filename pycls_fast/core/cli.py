"""Shared command-line handling for tools/: config arguments and exit codes.

Exit status: 0 on success, 2 for a user mistake (bad argument, bad config, missing
file), 1 for a runtime failure. Errors are one line on stderr naming what is wrong.
"""

import argparse
import sys

from pycls_fast.config import ConfigError, load_cfg


class UserError(Exception):
    """A mistake in what the user asked for (exit status 2)."""


def config_parser(description):
    """Returns an ArgumentParser with pycls's `--cfg FILE [KEY VALUE ...]` arguments."""
    parser = argparse.ArgumentParser(
        description=description,
        epilog="KEY VALUE pairs override config keys, e.g. OPTIM.BASE_LR 0.001 "
        "(see docs/CONFIG.md).",
    )
    parser.add_argument("--cfg", dest="cfg_file", required=True, help="config file")
    parser.add_argument("opts", nargs="*", help="config overrides: KEY VALUE ...")
    parser.parse_args = parser.parse_intermixed_args  # options may follow KEY VALUE
    return parser


def cfg_from_args(args):
    """Loads and checks the config named by parsed `args` (raises ConfigError)."""
    return load_cfg(args.cfg_file, args.opts or [])


def _exit(code):
    # A torchrun worker that used a process group skips the interpreter's teardown
    # (core/distributed.py, exit_process); only look if that module is in use.
    distributed = sys.modules.get("pycls_fast.core.distributed")
    if distributed is not None:
        distributed.exit_process(code)
    sys.exit(code)


def run(main):
    """Runs `main()` and maps failures to one line on stderr and an exit status."""
    try:
        code = main()
    except (ConfigError, UserError) as e:
        print(f"error: {e}", file=sys.stderr)
        _exit(2)
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        _exit(130)
    except Exception as e:  # noqa: BLE001 - the last line of defence for tools
        # Errors that carry their exit status (a failed rank of a spawned job) name
        # what failed themselves.
        code = getattr(e, "exit_code", None)
        if getattr(e, "signum", None):  # stopped on request, checkpoint written
            print(e, file=sys.stderr)
        else:
            what = str(e) if code else f"{type(e).__name__}: {e}"
            print(f"error: {what}", file=sys.stderr)
        _exit(code or 1)
    _exit(code or 0)
