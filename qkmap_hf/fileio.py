"""Atomic file writes: a crash or Ctrl-C never leaves a half-written file that looks complete.

Every JSON, README, CSV, plot and copied file that qkmap_hf writes goes through these helpers
(tests/plugin/test_fileio.py greps the package for raw writes). The one mechanism is ``atomic_path``: write to a
temporary file beside the target, rename it into place only when the write succeeded. ``staged_folder`` does
the same for a whole save (``qkmap train``'s final model): everything is written into a hidden folder beside the
target, and only a complete save is moved in (renames, which need no space), so a full disk or a kill mid-save
leaves the old folder as it was. ``atomic_directory`` writes a new model folder whole (``qkmap convert``, the Qwen3
export): it appears complete, synced, or not at all.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .errors import ConversionError
from .locking import TEMPORARY_MARKER, hidden_temp_prefix


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary path beside ``path`` (same suffix) to write; renamed over ``path`` (mode 0644) when the block
    succeeds, removed when it fails. For writers that want a file name (``savefig``, ``copyfile``)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=path.suffix, dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o644)  # mkstemp makes 0600 files; these are meant to be shared and published
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)


def atomic_write_json(path: str | os.PathLike, data: Any) -> Path:
    """``atomic_write_text`` of ``data`` as indented JSON with a final newline."""
    return atomic_write_text(path, json.dumps(data, indent=2, default=str) + "\n")


def atomic_write_csv(path: str | os.PathLike, fieldnames: Sequence[str], rows: Iterable[Mapping[str, Any]]) -> Path:
    """``atomic_write_text`` of ``rows`` as CSV with a header line."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(fieldnames))
    writer.writeheader()
    writer.writerows(rows)
    return atomic_write_text(path, buffer.getvalue())


def atomic_copy(source: str | os.PathLike, target: str | os.PathLike) -> Path:
    """Copy ``source`` to ``target`` byte for byte, atomically."""
    with atomic_path(target) as tmp:
        shutil.copyfile(source, tmp)
    return Path(target)


def mark_temporary(folder: Path) -> None:
    """Mark ``folder`` as this package's temporary: only marked ones are ever removed (``qkmap_hf.locking``)."""
    (folder / TEMPORARY_MARKER).write_text(f"{os.getpid()}\n", encoding="utf-8")


def unmark_temporary(folder: Path) -> None:
    """Remove the marker before the folder becomes the user's (renamed into place or put back)."""
    (folder / TEMPORARY_MARKER).unlink(missing_ok=True)


@contextmanager
def staged_folder(folder: str | os.PathLike, drop: Callable[[Path], bool] = lambda entry: False) -> Iterator[Path]:
    """A hidden folder beside ``folder`` (``.NAME.tmp-PID-*``) to save into; when the block succeeds its entries
    replace those of the same name in ``folder`` and the entries of ``folder`` for which ``drop`` is true (files of
    the model being replaced) are removed; entries it does not name (checkpoints) stay. On failure it vanishes."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=hidden_temp_prefix(folder), dir=folder.parent))
    try:
        mark_temporary(staging)
        yield staging
        unmark_temporary(staging)
        folder.mkdir(exist_ok=True)
        for entry in sorted(folder.iterdir()):
            if (staging / entry.name).exists() or not drop(entry):
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        for entry in sorted(staging.iterdir()):
            target = folder / entry.name
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            os.replace(entry, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@contextmanager
def atomic_directory(dst: Path, overwrite: bool) -> Iterator[Path]:
    """Yield a hidden temporary folder beside ``dst``; on success it becomes ``dst``, on any failure it vanishes.

    Every file in it is synced before the rename. With ``overwrite`` the old ``dst`` is moved aside only
    once the new one is complete, and restored if the final rename fails. KeyboardInterrupt cleans up too;
    a hard kill leaves only the hidden ``.DST.tmp-PID-*``, which the next run into DST removes
    (``qkmap_hf.locking``).
    """
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=hidden_temp_prefix(dst), dir=dst.parent))
    try:
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)
        mark_temporary(tmp)
        yield tmp
        unmark_temporary(tmp)
        for path in sorted(tmp.iterdir()):
            if path.is_file():
                _fsync(path, os.O_RDONLY)
        _fsync(tmp, os.O_RDONLY)
        if dst.exists():
            if any(dst.iterdir()) and not overwrite:
                raise ConversionError(f"DST {dst} was filled by someone else during the conversion; not replacing it.")
            old = dst.parent / f"{hidden_temp_prefix(dst, 'old')}{uuid.uuid4().hex[:8]}"
            dst.rename(old)
            mark_temporary(old)
            try:
                tmp.rename(dst)
            except BaseException:
                unmark_temporary(old)
                old.rename(dst)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(dst)
        _fsync(dst.parent, os.O_RDONLY)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _fsync(path: Path, flags: int) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, flags)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
