"""User-facing error types and the exit codes of the `memopd` command line.

A `UserError` is bad input that the user can fix (a wrong argument, a missing or damaged
file, a config value of the wrong type, a run directory in use). The CLI prints it as one
line naming the thing and the fix, and exits with the error's `exit_code`; anything else
is a bug and exits with `EXIT_INTERNAL` and a traceback.

Exit codes (stable, documented in the README):

    0   success
    1   a check ran and failed (e.g. `memopd audit` found an RCE violation)
    2   bad input: arguments, config values, input files, model directories
    3   run-directory conflict: in use by another process, not empty without
        --resume/--overwrite, or resumed with a different config
    70  internal error (a bug: the traceback is printed)
    130 interrupted (Ctrl-C)
"""
from __future__ import annotations

__all__ = [
    "UserError",
    "RunDirError",
    "EXIT_OK",
    "EXIT_CHECK_FAILED",
    "EXIT_BAD_INPUT",
    "EXIT_RUN_CONFLICT",
    "EXIT_INTERNAL",
    "EXIT_INTERRUPTED",
]

EXIT_OK = 0
EXIT_CHECK_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_RUN_CONFLICT = 3
EXIT_INTERNAL = 70
EXIT_INTERRUPTED = 130


class UserError(Exception):
    """Bad input the user can fix; the message names the input and the fix."""

    exit_code = EXIT_BAD_INPUT


class RunDirError(UserError):
    """A run directory that cannot be used as asked (locked, not empty, other config)."""

    exit_code = EXIT_RUN_CONFLICT
