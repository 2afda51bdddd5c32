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
    69  a peer process failed: another rank of a distributed run died or hung up, or the
        teacher server (`teacher_url=`) stopped answering; the message names the peer's
        address; that process's log holds the cause
    70  internal error (a bug: the traceback is printed)
    71  out of memory (the allocator or the operating system refused memory)
    74  an output could not be written: the operating system refused or failed the
        write (no space, quota, read-only filesystem, permission, I/O error); the
        message names the path, the cause and what is still complete
    130 interrupted (Ctrl-C)
    143 terminated (SIGTERM, as SLURM, Kubernetes and systemd stop a job): handled as
        Ctrl-C, what is complete is kept and `--resume` continues
"""
from __future__ import annotations

import errno
import os
import re

__all__ = [
    "UserError",
    "ConfigError",
    "RunDirError",
    "UnsafeFileError",
    "PeerError",
    "OutputError",
    "os_failure",
    "output_error",
    "EXIT_IO_ERROR",
    "EXIT_OK",
    "EXIT_CHECK_FAILED",
    "EXIT_BAD_INPUT",
    "EXIT_RUN_CONFLICT",
    "EXIT_INTERNAL",
    "EXIT_PEER_FAILED",
    "EXIT_OUT_OF_MEMORY",
    "system_failure",
    "EXIT_INTERRUPTED",
    "EXIT_TERMINATED",
    "Terminated",
]

EXIT_OK = 0
EXIT_CHECK_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_RUN_CONFLICT = 3
EXIT_PEER_FAILED = 69  # EX_UNAVAILABLE of sysexits.h
EXIT_INTERNAL = 70
EXIT_OUT_OF_MEMORY = 71  # EX_OSERR
EXIT_IO_ERROR = 74  # EX_IOERR of sysexits.h
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143  # 128 + SIGTERM, what a shell reports for a process SIGTERM ended


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the program is (the `memopd` command line's handler): a
    KeyboardInterrupt, so everything that cleans up after Ctrl-C (temp files, worker
    pools, children, the run-directory lock) does the same for it."""


class UserError(Exception):
    """Bad input the user can fix; the message names the input and the fix."""

    exit_code = EXIT_BAD_INPUT


class ConfigError(UserError, ValueError):
    """A run configuration that cannot run as given (`memopd train` key=value, config.yaml)."""


class RunDirError(UserError):
    """A run directory that cannot be used as asked (locked, not empty, other config)."""

    exit_code = EXIT_RUN_CONFLICT


class UnsafeFileError(UserError):
    """A file memopd will not load because loading it could run code (a pickle holding
    more than tensors and plain values, or a checkpoint format that needs unpickling)."""


class PeerError(UserError):
    """A peer process this one depends on (the teacher server) failed or cannot be reached."""

    exit_code = EXIT_PEER_FAILED


class OutputError(UserError):
    """An operating-system failure while writing an output (not a bug, not bad input)."""

    exit_code = EXIT_IO_ERROR
    code: int | None = None  # the errno of the failure


# the OS failures of a write that the user fixes outside memopd, worded for a message
_CAUSES = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only filesystem",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EIO: "I/O error of the device",
}
_FIXES = {
    errno.ENOSPC: "free space",
    errno.EDQUOT: "free space or raise the quota",
    errno.EROFS: "make the filesystem writable",
    errno.EACCES: "fix the permissions",
    errno.EPERM: "fix the permissions",
    errno.EIO: "check the device",
}


_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)|Os \{ code: (\d+)")


def _chain(exc: BaseException) -> list[BaseException]:
    """`exc` and the exceptions it was raised from or during, each once."""
    out: list[BaseException] = []
    e: BaseException | None = exc
    while e is not None and all(e is not x for x in out):
        out.append(e)
        e = e.__cause__ or e.__context__
    return out


def _free_bytes(path: str | os.PathLike | None) -> int | None:
    p = os.path.abspath(os.fspath(path)) if path is not None else None
    while p:
        try:
            st = os.statvfs(p)
            return st.f_bavail * st.f_frsize
        except OSError:
            parent = os.path.dirname(p)
            p = None if parent == p else parent
    return None


def os_failure(exc: BaseException, path: str | os.PathLike | None = None) -> int | None:
    """The errno of `exc` when it is an operating-system failure of a write (one of
    ENOSPC, EDQUOT, EROFS, EACCES, EPERM, EIO), else None.

    torch.save reports a failed write as a RuntimeError of its zip writer ("[enforce fail
    at inline_container.cc:...] ...") without the errno; `path` (what was being written)
    then decides: no free space left there means ENOSPC, else EIO if the text says the
    write failed."""
    seen = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:  # also an OSError a library re-raised as another type
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _CAUSES:
            return e.errno
        e = e.__cause__ or e.__context__
    for e in _chain(exc):  # a library's text of an OS error: safetensors (Rust) says
        m = _RUST_OS_ERROR.search(str(e))  # "... (os error 28)" or "Os { code: 28, ... }"
        if m and int(m.group(1) or m.group(2)) in _CAUSES:
            return int(m.group(1) or m.group(2))
    text = str(exc)
    if isinstance(exc, RuntimeError) and ("inline_container" in text or "PytorchStreamWriter" in text):
        # on a full disk the text is e.g. "[enforce fail at inline_container.cc:672] .
        # unexpected pos 576 vs 534" (measured on a full tmpfs): the free space decides
        free = _free_bytes(path)
        if free is not None and free < (1 << 20):
            return errno.ENOSPC
        return errno.EIO if "write" in text.lower() else None
    return None


def output_error(code: int, what: str, path: str | os.PathLike, survived: str = "",
                 then: str = "run again") -> "OutputError":
    """The one-line OutputError of a failed write: "<what> not written: <cause> (<path>);
    <survived>; <remedy of the cause> and <then>"."""
    where = "" if os.fspath(path) in ("", what) else f" ({os.fspath(path)})"
    parts = [f"{what} not written: {_CAUSES.get(code, os.strerror(code))}{where}"]
    if survived:
        parts.append(survived)
    parts.append(f"{_FIXES.get(code, 'fix the cause')} and {then}")
    err = OutputError("; ".join(parts))
    err.code = code
    return err


# what gloo and NCCL say when the process at the other end of a connection is gone
_PEER_GONE = re.compile(r"Connection (?:closed|reset) by peer|Broken pipe|remote process exited|"
                        r"NCCL communicator was aborted|DistNetworkError")
_PEER_ADDRESS = re.compile(r"\[([0-9A-Fa-f.:]+)\]:(\d+)")
_NO_MEMORY = re.compile(r"can't allocate memory|CUDA out of memory|out of memory", re.IGNORECASE)


def system_failure(exc: BaseException) -> tuple[int, str] | None:
    """(exit code, one line) of a failure of the machine or of a peer rather than of
    memopd or its input: a peer rank of a distributed run that died or hung up (exit 69,
    naming its address), or memory refused (exit 71); None otherwise."""
    for e in _chain(exc):
        text = str(e)
        if isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError" or (
                isinstance(e, RuntimeError) and _NO_MEMORY.search(text)):
            said = text.strip().splitlines()[0][:200] if text.strip() else type(e).__name__
            return EXIT_OUT_OF_MEMORY, (f"out of memory ({said}): free memory, raise the memory limit, or make the "
                                        "batches smaller (tasks_per_step, group_size, max_tokens); a run continues "
                                        "with --resume")
        if isinstance(e, RuntimeError) and _PEER_GONE.search(text):
            m = _PEER_ADDRESS.search(text)
            peer = f" at {m.group(1)}:{m.group(2)}" if m else ""
            return EXIT_PEER_FAILED, (f"a peer process of this distributed run{peer} failed ({_PEER_GONE.search(text).group(0)}): "
                                      "another rank stopped or crashed; its log holds the cause. Fix that and run "
                                      "again (a run continues with --resume)")
    return None
