"""Atomic writes: the helpers keep the old file on failure, and the package writes files only through them."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from qkmap_hf.fileio import atomic_copy, atomic_path, atomic_write_csv, atomic_write_json, atomic_write_text

PACKAGE = Path(__file__).resolve().parents[2] / "qkmap_hf"
RAW_WRITES = {
    "write_text": re.compile(r"\.write_text\("),
    "write_bytes": re.compile(r"\.write_bytes\("),
    "json.dump": re.compile(r"\bjson\.dump\("),
    "open for writing": re.compile(r"\bopen\([^)]*[\"'][wax]b?\+?[\"']"),
    "os.open for writing": re.compile(r"\bos\.open\([^)]*O_(WRONLY|RDWR|CREAT)"),
    "shutil copy": re.compile(r"\bshutil\.copy(file|2)?\("),
    "savefig": re.compile(r"\.savefig\("),
    "torch.save": re.compile(r"\btorch\.save\("),
}
# Writes that are atomic another way, with the reason.
ALLOWED = {
    ("fileio.py", "write_text"): "the helper itself",
    ("fileio.py", "shutil copy"): "the helper itself (copy to a temporary path, then rename)",
    ("plotting.py", "savefig"): "into fileio.atomic_path's temporary path",
    ("assets.py", "open for writing"): "extracts into a staging folder that is renamed into the cache when complete",
    ("assets.py", "write_bytes"): "extracts into a staging folder that is renamed into the cache when complete",
    ("conversion/writer.py", "os.open for writing"): "streams safetensors into the staging folder renamed at the end",
    ("locking.py", "os.open for writing"): "the lock file: flock needs the file itself; it holds only the pid",
    ("serving.py", "open for writing"): "a server's log, streamed by the server process as it runs (not a record)",
}


def test_package_writes_files_only_through_the_atomic_helpers():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for kind, pattern in RAW_WRITES.items():
                if pattern.search(line) and (relative, kind) not in ALLOWED:
                    found.append(f"qkmap_hf/{relative}:{number}: {kind}: {line.strip()}")
    assert not found, "raw writes (use qkmap_hf.fileio):\n" + "\n".join(found)
    # the scan sees what it must: every allowed exception still occurs (else the allowlist is stale)
    for relative, kind in ALLOWED:
        assert RAW_WRITES[kind].search((PACKAGE / relative).read_text(encoding="utf-8")), (relative, kind)


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    target = atomic_write_json(tmp_path / "record.json", {"step": 1})
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        tmp.write_text('{"step": 2, "trunc', encoding="utf-8")
        raise RuntimeError("crash mid-write")
    assert json.loads(target.read_text()) == {"step": 1}
    with pytest.raises(FileNotFoundError):
        atomic_copy(tmp_path / "missing.png", tmp_path / "copy.png")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["record.json"]
    assert target.stat().st_mode & 0o777 == 0o644


def test_text_csv_and_copy_round_trip(tmp_path):
    atomic_write_text(tmp_path / "README.md", "# title\n")
    atomic_write_csv(tmp_path / "rows.csv", ["mode", "loss"], [{"mode": "qk_map", "loss": 1.5}])
    atomic_copy(tmp_path / "rows.csv", tmp_path / "copy.csv")
    assert (tmp_path / "README.md").read_text() == "# title\n"
    assert (tmp_path / "copy.csv").read_text().splitlines() == ["mode,loss", "qk_map,1.5"]


def test_a_staged_folder_replaces_only_when_complete(tmp_path):
    from qkmap_hf.fileio import staged_folder

    out = tmp_path / "out"
    (out / "checkpoint-1").mkdir(parents=True)
    (out / "checkpoint-1" / "state.json").write_text("{}")
    (out / "model.safetensors").write_bytes(b"old weights")
    (out / "old-shard.safetensors").write_bytes(b"old shard")
    with pytest.raises(OSError), staged_folder(out) as staging:
        (staging / "model.safetensors").write_bytes(b"new wei")
        raise OSError(28, "No space left on device")
    assert (out / "model.safetensors").read_bytes() == b"old weights"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no hidden staging folder left
    with staged_folder(out, drop=lambda entry: entry.suffix == ".safetensors") as staging:
        assert staging.parent == tmp_path and staging.name.startswith(".out.tmp-")
        (staging / "model.safetensors").write_bytes(b"new weights")
    assert (out / "model.safetensors").read_bytes() == b"new weights"
    assert not (out / "old-shard.safetensors").exists()  # dropped: not part of the new save
    assert (out / "checkpoint-1" / "state.json").read_text() == "{}"  # not named by the save: kept
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
