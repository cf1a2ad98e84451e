"""Atomic file writes: a crash or Ctrl-C never leaves a half-written file that looks complete."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to a temporary file beside ``path`` and rename it into place (mode 0644)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.fchmod(fd, 0o644)  # mkstemp makes 0600 files; these are meant to be shared and published
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_write_json(path: str | os.PathLike, data: Any) -> Path:
    """``atomic_write_text`` of ``data`` as indented JSON with a final newline."""
    return atomic_write_text(path, json.dumps(data, indent=2, default=str) + "\n")
