"""One writer per output folder, and what a dead writer left behind.

Two ``qkmap`` runs into one folder used to both report success with their results mixed. Every command that
writes a folder (convert, train, heal, compare, card) or publishes one (push) holds ``output_lock`` on it for its
whole run: an ``fcntl.flock`` on ``.NAME.qkmap-lock`` beside the folder (beside, not inside, because convert
replaces the folder by a rename). The lock file records the holder's pid; a second writer refuses naming it. The
kernel releases the lock when the process dies, however it dies, so a stale lock file never blocks anyone.

Hidden temporary folders beside a folder (``.NAME.tmp-PID-*``, ``.NAME.old-PID-*``: ``hidden_temp_prefix``) carry
their writer's pid in the name and a marker file inside (``TEMPORARY_MARKER``, written by ``fileio.mark_temporary``). Under the lock,
those whose writer is gone are left-overs of a run killed mid-write (``kill -9``, power loss);
``remove_stale_temporaries`` deletes them (or puts back a folder a dead run had moved aside and not replaced) and
says so. A folder without both, however its name looks (a user's ``.converted.tmp-notes/``), is never touched.

The lock file is opened without following a symlink: a lock path that is a link (dangling or not) is refused, so
no command writes through it to a file elsewhere.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

LOCK_SUFFIX = ".qkmap-lock"
_TEMP_KINDS = ("tmp", "old")
TEMPORARY_MARKER = ".qkmap-temporary"


class FolderLockedError(ValueError):
    """Another live process holds the lock of the folder (a refusal: one line, exit code 2)."""


def lock_path(folder: str | os.PathLike) -> Path:
    """``.NAME.qkmap-lock`` beside ``folder`` (resolved: two spellings of one folder share one lock)."""
    folder = Path(folder).expanduser().resolve()
    return folder.parent / f".{folder.name}{LOCK_SUFFIX}"


def hidden_temp_prefix(folder: str | os.PathLike, kind: str = "tmp") -> str:
    """Name prefix of a hidden temporary beside ``folder`` (``kind``: ``tmp`` new content, ``old`` moved aside),
    carrying this process's pid so that a later run can tell a dead writer's left-over from a live one."""
    if kind not in _TEMP_KINDS:
        raise ValueError(f"kind must be one of {_TEMP_KINDS}, not {kind!r}.")
    return f".{Path(folder).name}.{kind}-{os.getpid()}-"


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _holder(path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace").split()
    except OSError:
        return "unknown"
    return text[0] if text and text[0].isdigit() else "unknown"


@contextlib.contextmanager
def output_lock(folder: str | os.PathLike, command: str = "qkmap") -> Iterator[Path | None]:
    """Hold the writer's lock of ``folder`` for the block; ``FolderLockedError`` naming the holder's pid if another
    process holds it. Yields the lock file, or ``None`` where none can be created (a read-only location: the
    command then fails, or only reads, on its own)."""
    folder = Path(folder).expanduser().resolve()
    path = lock_path(folder)
    created = [p for p in (path.parent, *path.parent.parents) if not p.exists()]  # deepest first
    while True:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as error:
            if error.errno == errno.ELOOP or path.is_symlink():
                raise FolderLockedError(
                    f"{path}: the lock file of {folder} is a symbolic link; remove it (a lock is never written "
                    "through a link)."
                ) from None
            if error.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
                yield None
                return
            raise
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise FolderLockedError(
                f"{folder} is being written by another qkmap command (pid {_holder(path)}, lock file {path}); "
                "wait for it to finish or choose another folder."
            ) from None
        try:  # the holder before us may have removed the file after we opened it: lock the current one instead
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()} {command}\n".encode())
        yield path
    finally:
        with contextlib.suppress(OSError):
            path.unlink()
        os.close(fd)  # releases the flock
        for parent in created:  # folders made only to hold the lock file (a refused command leaves none)
            try:
                parent.rmdir()
            except OSError:  # not empty: the command wrote there
                break


def stale_temporaries(folder: str | os.PathLike) -> list[tuple[Path, int | None]]:
    """Hidden ``.NAME.tmp-PID-*`` / ``.NAME.old-PID-*`` folders beside ``folder`` that carry this package's marker and
    whose writer is not alive, with its pid. Meaningful only while holding ``output_lock``."""
    folder = Path(folder).expanduser().resolve()
    if not folder.parent.is_dir():
        return []
    pattern = re.compile(rf"^\.{re.escape(folder.name)}\.(?:{'|'.join(_TEMP_KINDS)})-(\d+)-")
    found = []
    for entry in sorted(folder.parent.iterdir()):
        match = pattern.match(entry.name)
        if not match or not entry.is_dir() or entry.is_symlink() or not (entry / TEMPORARY_MARKER).is_file():
            continue
        pid = int(match.group(1))
        if _pid_alive(pid):
            continue
        found.append((entry, pid))
    return found


def remove_stale_temporaries(folder: str | os.PathLike, command: str = "qkmap") -> list[Path]:
    """Delete what dead runs left beside ``folder`` (see the module docstring), one line on stderr for each; a
    folder moved aside (``.old-``) whose replacement never arrived is put back instead. Call under the lock."""
    folder = Path(folder).expanduser().resolve()
    handled = []
    for entry, pid in stale_temporaries(folder):
        owner = f"pid {pid}"
        if ".old-" in entry.name and not folder.exists():
            (entry / TEMPORARY_MARKER).unlink(missing_ok=True)  # the folder is the user's again
            entry.rename(folder)
            print(
                f"{command}: restored {folder} from {entry.name}, left by {owner}, which died mid-replace.",
                file=sys.stderr,
            )
        else:
            shutil.rmtree(entry, ignore_errors=True)
            print(
                f"{command}: removed {entry}, a temporary folder left by {owner}, which did not finish.",
                file=sys.stderr,
            )
        handled.append(entry)
    return handled


@contextlib.contextmanager
def claim_output(folder: str | os.PathLike | None, command: str) -> Iterator[None]:
    """What every writing command does first: take the lock of ``folder`` (only rank 0 under a launcher) and clear
    dead runs' temporaries. ``None``: nothing to claim."""
    if folder is None or int(os.environ.get("RANK", "0")) != 0:
        yield
        return
    with output_lock(folder, command) as held:
        if held is not None:
            remove_stale_temporaries(folder, command)
        yield


__all__ = [
    "FolderLockedError",
    "claim_output",
    "hidden_temp_prefix",
    "lock_path",
    "output_lock",
    "remove_stale_temporaries",
    "stale_temporaries",
]
