"""Every error type of pycls_fast, each with the exit status a tool ends with.

A leaf module: it imports nothing of the package, so every layer can raise these
errors, and the command line (launch/cli.py) and spawned ranks
(launch/processes.py) map an exception to its exit status in one place, `exit_code`.

    0   success
    1   a runtime failure (PyclsFastError, or any other exception)
    2   a user mistake: bad argument, bad config, missing or unusable file
    128 + N   stopped by signal N after writing a checkpoint (Stopped)
    130 interrupted (KeyboardInterrupt)
"""

USER_MISTAKE = 2
RUNTIME_FAILURE = 1
INTERRUPTED = 130


class PyclsFastError(Exception):
    """Base of pycls_fast's errors; `exit_code` is the status a tool ends with."""

    exit_code: int = RUNTIME_FAILURE


class UserError(PyclsFastError):
    """A mistake in what the user asked for: one line naming the key, path or file."""

    exit_code = USER_MISTAKE


class ConfigError(UserError, ValueError):
    """A mistake in a config file or override: one line naming the key."""


class DeviceError(ConfigError):
    """The devices the config or launcher asks for cannot be used (no GPU visible,
    a driver too old for this torch build, two ranks on one GPU); says how to fix."""


class CheckpointError(UserError):
    """A checkpoint that cannot be used: missing, truncated, from another model, or
    holding objects that loading would have to execute."""


class BadImagesError(UserError):
    """More images failed to decode than DATA_LOADER.MAX_BAD_FRAC allows."""


class LoaderProcessError(PyclsFastError):
    """A loader subprocess ('subprocess' mode) failed, ended or stopped answering; the
    message names the error it raised or how it ended."""


class OutDirInUseError(UserError):
    """Another training holds OUT_DIR."""


class NonFiniteLossError(PyclsFastError):
    """The loss became NaN or inf: training stops instead of writing garbage."""


class LossSpikeError(PyclsFastError):
    """TRAIN.SPIKE_MAX_SKIPS steps in a row were skipped as loss spikes."""


class Stopped(PyclsFastError):
    """Training stopped on a signal after writing a checkpoint. `exit_code` is
    128 + the signal number, as a shell reports a process ended by that signal."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum
        self.exit_code = 128 + signum


class RankFailedError(PyclsFastError):
    """A rank of a job this process launched failed; `exit_code` is the status the
    job ends with (the rank's own 1 or 2; 1 when it was killed)."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def exit_code(error: BaseException) -> int:
    """The exit status a tool ends with after `error`."""
    if isinstance(error, KeyboardInterrupt):
        return INTERRUPTED
    if isinstance(error, PyclsFastError):
        return error.exit_code
    return RUNTIME_FAILURE


def error_line(error: BaseException) -> str:
    """The one line printed for `error`: user mistakes and pycls_fast's own errors
    by their message, anything unexpected with its type (a bug to report)."""
    if isinstance(error, KeyboardInterrupt):
        return "error: interrupted"
    if isinstance(error, Stopped):
        return str(error)  # a requested stop, the checkpoint is written
    if isinstance(error, PyclsFastError):
        return f"error: {error}"
    return f"error: {type(error).__name__}: {error}"
