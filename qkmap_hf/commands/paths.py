"""Path arguments checked where they enter: a path that does not exist is named with its option, not left to
fail later as a repo-id or tokenizer error deep inside a library."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from ..loading import is_repo_id


def require_path(option: str, value: str | None, what: str = "file or folder", *, hub_id_ok: bool = False) -> None:
    """Raise ``FileNotFoundError`` naming ``option`` and ``value`` unless the path exists (or may be a Hub id)."""
    if value is None or Path(value).expanduser().exists():
        return
    if hub_id_ok and is_repo_id(value):
        return
    hint = " (or a Hub repo id in the local cache)" if hub_id_ok else ""
    raise FileNotFoundError(f"{option} {value}: no such {what}{hint}; check the path.")


def require_paths(option: str, values: Iterable[str] | None, what: str = "file or folder") -> None:
    """``require_path`` for each value of a repeatable / multi-value option."""
    for value in values or ():
        require_path(option, value, what)
