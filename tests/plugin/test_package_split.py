"""The plugin (``qkmap_hf``) and the research lab (``qkmap_lab``): the plugin never imports the lab, the moved
modules keep their old names for one release, and the plugin reaches the lab's tasks only through its entry point."""

from __future__ import annotations

import ast
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import qkmap_hf
from qkmap_hf import task_sources
from qkmap_hf.moved import MOVED_MODULES

PACKAGE = Path(qkmap_hf.__file__).resolve().parent
ALIAS_TABLE = PACKAGE / "moved.py"


def _lab_imports(path: Path) -> list[str]:
    """``file:line: target`` for every import of the lab in a module, written as a statement or as a string."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            targets = [node.module]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            targets = [node.value] if node.value.split(".")[0] == "qkmap_lab" else []
        found += [f"{path.relative_to(PACKAGE)}:{node.lineno}: {t}" for t in targets if t.split(".")[0] == "qkmap_lab"]
    return found


def test_the_plugin_never_imports_the_lab():
    """Only the alias table names lab modules, and only as text for the old names' finder."""
    offending = [hit for path in sorted(PACKAGE.rglob("*.py")) if path != ALIAS_TABLE for hit in _lab_imports(path)]
    assert offending == []
    assert all(new.startswith("qkmap_lab.") for new in MOVED_MODULES.values())


def test_the_scan_finds_an_import_of_the_lab(tmp_path):
    """The direction test can fail: a module that imports the lab, by statement or by name, is found."""
    module = PACKAGE / "_probe_for_the_direction_test.py"
    module.write_text(
        "import qkmap_lab.stability\nfrom importlib import import_module\nimport_module('qkmap_lab.cli')\n"
    )
    try:
        assert [hit.split(": ")[1] for hit in _lab_imports(module)] == ["qkmap_lab.stability", "qkmap_lab.cli"]
    finally:
        module.unlink()


@pytest.mark.slow
def test_importing_every_plugin_module_loads_no_lab_module():
    code = """
import pkgutil, sys, importlib, qkmap_hf
skip = {"qkmap_hf.__main__", "qkmap_hf.moved"}
for info in pkgutil.walk_packages(qkmap_hf.__path__, "qkmap_hf."):
    if info.name not in skip:
        importlib.import_module(info.name)
print(sorted(m for m in sys.modules if m.split(".")[0] == "qkmap_lab"))
"""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=PACKAGE.parent.parent
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize("old", sorted(MOVED_MODULES))
def test_a_moved_module_keeps_its_old_name_with_a_deprecation_notice(old):
    import importlib

    sys.modules.pop(old, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    assert module is importlib.import_module(MOVED_MODULES[old])
    notices = [w for w in caught if issubclass(w.category, FutureWarning) and old in str(w.message)]
    assert len(notices) == 1 and MOVED_MODULES[old] in str(notices[0].message)
    assert "\n" not in str(notices[0].message)


@pytest.mark.slow
def test_python_m_with_an_old_name_runs_the_moved_command():
    done = subprocess.run(
        [sys.executable, "-m", "qkmap_hf.stability", "--help"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "usage: qkmap-lab stability" in done.stdout
    assert "qkmap_lab.stability" in done.stderr  # the notice


def test_the_labs_tasks_come_through_the_entry_point():
    source, task = task_sources.parse_task("mqar:num_pairs=3")
    assert type(source).__module__.split(".")[0] == "qkmap_lab"
    assert source.spec(task).startswith("mqar:") and "num_pairs=3" in source.spec(task)
    assert source.parse(source.spec(task)) == task


def test_an_unknown_task_and_a_missing_source_are_refused_in_one_line(monkeypatch):
    with pytest.raises(ValueError, match=r"unknown task 'mqr'; choose one of: .*mqar") as refused:
        task_sources.source_for("mqr:num_pairs=2")
    assert "\n" not in str(refused.value)
    monkeypatch.setattr(task_sources, "task_sources", lambda: ())
    with pytest.raises(ValueError, match="no task source is installed") as refused:
        task_sources.source_for("mqar")
    assert "\n" not in str(refused.value)
