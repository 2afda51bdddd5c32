"""Files that are whole or absent: atomic writes, manifests, directory locks.

Below both the environment (`memopd.env.qa.sft` writes its SFT cache with these) and the
trainer (`trainer/rundir.py` builds run directories on them), so neither imports the other:

- `atomic_file` / `atomic_write_text` / `atomic_write_json` / `atomic_directory`: a file or
  directory is replaced all at once, durably, or left as it was; an operating-system
  failure of the write is one `OutputError` (`guarded_write`) naming what was not written;
- `write_manifest` / `read_manifest` / `verify_manifest`: size + sha256 of every file of a
  directory, written last, so its presence and a passing check mean "complete and intact";
- `weights_fingerprint`: the sha256 of a model directory's weight files, which a run's
  checkpoints record so that --resume knows the models it trained with;
- `check_writable_dir`: a directory exists and takes files, checked before long work;
- `DirectoryLock`: an exclusive flock on a file in a directory, naming its holder.
"""
from __future__ import annotations

import contextlib
import datetime
import errno
import hashlib
import json
import os
import shutil
import socket
import sys
import tempfile
from typing import Any, Callable

from memopd.errors import OutputError, RunDirError, UserError, os_failure, output_error

__all__ = [
    "MANIFEST",
    "LOCK_FILE",
    "guarded_write",
    "atomic_file",
    "atomic_write_text",
    "atomic_write_json",
    "atomic_directory",
    "write_manifest",
    "read_manifest",
    "verify_manifest",
    "check_writable_dir",
    "weights_fingerprint",
    "DirectoryLock",
]

MANIFEST = "memopd_manifest.json"
LOCK_FILE = ".lock"
_CHUNK = 1 << 20


# --------------------------------------------------------------------------- atomic writes


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems cannot fsync a directory; the rename is still atomic
    finally:
        os.close(fd)


@contextlib.contextmanager
def guarded_write(what: str, path: str | os.PathLike, survived: str = "", fix: str = ""):
    """Turn an operating-system failure of the writes inside (ENOSPC, EDQUOT, EROFS,
    EACCES, EPERM, EIO, and torch.save's errno-less RuntimeError of a full disk) into one
    `OutputError` (exit 74) naming `what`, `path`, the cause and what `survived`; other
    errors pass unchanged. The block must itself leave no partial file behind."""
    try:
        yield
    except OutputError:
        raise
    except Exception as e:
        code = os_failure(e, path)
        if code is None:
            raise
        raise output_error(code, what, path, survived, fix) from e


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def _current_umask() -> int:
    mask = os.umask(0o022)  # reading the umask means setting it: put it straight back
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, what: str | None = None):
    """Yield a temp path next to `path` to write; on success it replaces `path` all at
    once, so readers (and a resumed run after a kill) see the old content or the new one,
    never a part. On an error the temp file is removed and `path` keeps its content; an OS
    failure of the write is an `OutputError` naming `what` (default: the path)."""
    path = os.fspath(path)
    d = os.path.dirname(path) or "."
    before = "its previous content is unchanged" if os.path.exists(path) else ""
    with guarded_write(what or path, path, before):
        fd, tmp = tempfile.mkstemp(dir=d, prefix=os.path.basename(path) + ".", suffix=".tmp")
        os.close(fd)
        # mkstemp's 0600 would become the final file's mode: give it a plain open()'s
        # (0666 less the umask), so team-mates read config.yaml like metrics.jsonl
        os.chmod(tmp, 0o666 & ~_current_umask())
        try:
            yield tmp
            os.replace(tmp, path)
        except BaseException:
            _remove_quietly(tmp)
            raise
    _fsync_dir(d)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Replace `path` by `text` all at once (`atomic_file`), durably (fsync)."""
    with atomic_file(path) as tmp:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, default=str) + "\n")


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike, what: str | None = None):
    """Yield a fresh sibling directory to fill; on success it takes `path`'s place, so
    `path` holds either the previous complete content or the new one, never a mix or a
    part (a kill in between leaves `path` as it was, or absent for one rename, plus a
    `.tmp` sibling). On an error the partial directory is removed and `path` is untouched;
    an OS failure of a write is an `OutputError` naming `what` (default: the path)."""
    path = os.path.abspath(os.fspath(path))
    parent = os.path.dirname(path)
    before = "its previous content is unchanged" if os.path.lexists(path) else ""
    with guarded_write(what or path, path, before):
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=parent, prefix=os.path.basename(path) + ".", suffix=".tmp")
        try:
            os.chmod(tmp, 0o777 & ~_current_umask())  # mkdtemp's 0700 would become the final directory's mode
            yield tmp
            old = None
            if os.path.lexists(path):
                old = tempfile.mkdtemp(dir=parent, prefix=os.path.basename(path) + ".", suffix=".old.tmp")
                os.rmdir(old)
                os.replace(path, old)
            os.replace(tmp, path)
            _fsync_dir(parent)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


# --------------------------------------------------------------------------- manifests


def _digest(path: str) -> tuple[int, str]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while True:
            b = f.read(_CHUNK)
            if not b:
                break
            h.update(b)
            size += len(b)
    return size, h.hexdigest()


def _files_under(root: str) -> list[str]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            rel = os.path.relpath(os.path.join(dirpath, name), root)
            if rel != MANIFEST:
                out.append(rel)
    return out


def write_manifest(root: str | os.PathLike, **extra: Any) -> dict:
    """Record size + sha256 of every file under `root` in root/MANIFEST (atomic, last).

    Call it once everything under `root` is written (after the barrier that follows all
    ranks' saves): its presence is what makes the directory complete."""
    root = os.fspath(root)
    files = {}
    for rel in _files_under(root):
        size, sha = _digest(os.path.join(root, rel))
        files[rel] = {"size": size, "sha256": sha}
    manifest = {"format": "memopd.manifest", "version": 1, **extra, "files": files}
    atomic_write_json(os.path.join(root, MANIFEST), manifest)
    return manifest


def read_manifest(root: str | os.PathLike) -> dict | None:
    try:
        with open(os.path.join(os.fspath(root), MANIFEST)) as f:
            m = json.load(f)
    except (OSError, ValueError):
        return None
    return m if isinstance(m, dict) and isinstance(m.get("files"), dict) else None


def verify_manifest(root: str | os.PathLike) -> list[str]:
    """What is wrong with the directory `root` ([] = complete and intact)."""
    root = os.fspath(root)
    if not os.path.isdir(root):
        return ["missing directory"]
    if not os.path.exists(os.path.join(root, MANIFEST)):
        return [f"no {MANIFEST} (its save never finished, or it predates manifests)"]
    m = read_manifest(root)
    if m is None:
        return [f"{MANIFEST} is unreadable"]
    if not m["files"]:
        return [f"{MANIFEST} lists no files"]
    problems = []
    for rel, want in sorted(m["files"].items()):
        p = os.path.join(root, rel)
        if not os.path.isfile(p):
            problems.append(f"{rel} is missing")
            continue
        size = os.path.getsize(p)
        if size != want.get("size"):
            problems.append(f"{rel} has {size} bytes, {want.get('size')} expected (truncated or replaced)")
        elif _digest(p)[1] != want.get("sha256"):
            problems.append(f"{rel} fails its sha256 check (corrupted)")
    return problems


# --------------------------------------------------------------------------- weights

# the files of a model directory that hold its weights (HF single or sharded checkpoints,
# torch saves); tokenizer and config files are not weights
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
_HASHED: dict[tuple, str] = {}  # (realpath, stat key) -> sha256, for this process


def _stat_key(st: os.stat_result) -> list[int]:
    # size, mtime, ctime and inode: a rewrite, a replacement or a restored mtime (touch -r
    # cannot restore the ctime) each change it; a change of the key only costs a rehash
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def weights_fingerprint(model_dir: str | os.PathLike, known: dict | None = None) -> dict | None:
    """{"path", "sha256", "files": {name: {"stat": [size, mtime_ns, ctime_ns, inode],
    "sha256"}}} of the weight files directly in `model_dir` (WEIGHT_SUFFIXES); None when it
    holds none. "sha256" is one hash over the sorted (name, file sha256) pairs.

    Each file is hashed once: a file whose stat key equals its entry in `known` (an
    earlier fingerprint of the same directory, e.g. the one a checkpoint recorded) or in
    this process's memo reuses that hash, so fingerprinting a large model is a stat per
    file after the first time."""
    model_dir = os.path.abspath(os.fspath(model_dir))
    try:
        names = sorted(n for n in os.listdir(model_dir)
                       if n.endswith(WEIGHT_SUFFIXES) and os.path.isfile(os.path.join(model_dir, n)))
    except OSError:
        return None
    if not names:
        return None
    before = (known or {}).get("files", {}) if isinstance(known, dict) else {}
    files = {}
    for name in names:
        p = os.path.join(model_dir, name)
        key = _stat_key(os.stat(p))
        memo = (os.path.realpath(p), *key)
        old = before.get(name) if isinstance(before.get(name), dict) else {}
        sha = old.get("sha256") if old.get("stat") == key else _HASHED.get(memo)
        if sha is None:
            sha = _digest(p)[1]
        _HASHED[memo] = sha
        files[name] = {"stat": key, "sha256": sha}
    whole = hashlib.sha256("".join(f"{n}\0{f['sha256']}\n" for n, f in files.items()).encode()).hexdigest()
    return {"path": model_dir, "sha256": whole, "files": files}


# --------------------------------------------------------------------------- places


def check_writable_dir(path: str | os.PathLike, what: str) -> str:
    """Create `path` if needed and prove it takes files (write + remove a probe);
    UserError naming the path otherwise. Returns the path."""
    path = os.fspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise UserError(f"{what} {path!r} is a file, not a directory: remove it or choose another path")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        parent = os.path.dirname(os.path.abspath(path))
        while parent and not os.path.exists(parent) and parent != os.path.dirname(parent):
            parent = os.path.dirname(parent)
        why = f"{parent!r} is a file" if os.path.isfile(parent) else (e.strerror or str(e))
        raise UserError(f"cannot create the {what} {path!r}: {why}; choose another path") from None
    probe = os.path.join(path, f".memopd_write_probe.{os.getpid()}")
    try:
        with open(probe, "w") as f:
            f.write("probe")
        os.remove(probe)
    except OSError as e:
        raise UserError(f"the {what} {path!r} is not writable: {e.strerror or e}; "
                        "fix its permissions or choose another path") from None
    return path


# --------------------------------------------------------------------------- locks


class DirectoryLock:
    """Exclusive ownership of a directory: flock on DIRECTORY/NAME for the owner's life
    (a run directory's `.lock`, the SFT cache's lock). `what` names the directory in the
    errors ("run directory", "SFT cache")."""

    def __init__(self, directory: str, name: str = LOCK_FILE, what: str = "directory"):
        self.directory = directory
        self.path = os.path.join(directory, name)
        self.what = what
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def holder(self) -> str:
        try:
            with open(self.path) as f:
                h = json.load(f)
            return (f"pid {h.get('pid')} on host {h.get('host')}, started {h.get('started')} "
                    f"(command: {h.get('command')})")
        except (OSError, ValueError, AttributeError):
            return "another process (it has not recorded itself yet)"

    def acquire(self, command: str | None = None, wait: Callable[[str], None] | None = None) -> None:
        """Take the lock or raise RunDirError naming its holder; with `wait`, call
        `wait(message)` once and block until the holder releases it (or dies: the kernel
        frees a dead process's flock)."""
        import fcntl

        if self._fd is not None:
            return
        try:
            # O_NOFOLLOW: a lock file planted as a link would have its target truncated and
            # overwritten by the holder's record (in a shared directory, anyone's file)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)  # not inherited by exec'd children
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise UserError(f"the lock file {self.path!r} of the {self.what} is a symbolic link (to "
                                f"{os.readlink(self.path)!r}); memopd never writes through one: remove the link") from None
            raise UserError(f"cannot lock the {self.what} {self.directory!r}: {e.strerror or e} ({self.path})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                os.close(fd)
                raise UserError(f"cannot lock the {self.what} {self.directory!r}: {e.strerror or e}") from None
            if wait is None:
                os.close(fd)
                raise RunDirError(
                    f"{self.what} {self.directory!r} is in use by {self.holder()}. Wait for that run to finish "
                    "(or stop it), or choose another run_dir") from None
            wait(f"{self.what} {self.directory!r} is in use by {self.holder()}; waiting for it")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except BaseException:
                os.close(fd)
                raise
        info = {"pid": os.getpid(), "host": socket.gethostname(),
                "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                "command": command if command is not None else " ".join(sys.argv)}
        data = (json.dumps(info) + "\n").encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
        os.fsync(fd)
        self._fd = fd

    def release(self) -> None:
        if self._fd is None:
            return
        import fcntl

        fd, self._fd = self._fd, None
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
