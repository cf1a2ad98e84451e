"""Modules that moved out of the plugin, kept importable under their old names for one release.

The research harness moved to the lab package (``qkmap_lab``). An old import (``import qkmap_hf.stability``) or
command (``python -m qkmap_hf.stability``) still works: this finder hands over the new module, with a one-line
``FutureWarning``. It is the one place in the plugin that names the lab, and only as text: nothing here imports
the lab unless the caller asks for a moved name (tests/plugin/test_layers.py holds both).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import CodeType, ModuleType

MOVED_MODULES: dict[str, str] = {
    "qkmap_hf.paper_claims": "qkmap_lab.paper_claims",
    "qkmap_hf.stability": "qkmap_lab.stability",
    "qkmap_hf.task_report": "qkmap_lab.task_report",
    "qkmap_hf.task_probes": "qkmap_lab.task_probes",
    "qkmap_hf.training.synthetic": "qkmap_lab.synthetic",
}


def _warn(old: str, new: str) -> None:
    warnings.warn(
        f"{old} moved to {new} (the research lab); import it from there: the old name goes in the next release.",
        FutureWarning,
        stacklevel=4,
    )


class _MovedLoader(importlib.abc.Loader):
    def __init__(self, old: str, new: str) -> None:
        self.old, self.new = old, new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        _warn(self.old, self.new)
        return importlib.import_module(self.new)

    def exec_module(self, module: ModuleType) -> None:
        """The new module ran when it was imported."""

    def get_code(self, fullname: str) -> CodeType:
        """``python -m OLD``: run the new module as ``__main__``."""
        _warn(self.old, self.new)
        return compile(
            f"import runpy\nrunpy.run_module({self.new!r}, run_name='__main__', alter_sys=True)\n", "<moved>", "exec"
        )


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Finds the old names of ``MOVED_MODULES`` (and nothing else)."""

    def find_spec(self, fullname: str, path=None, target=None) -> importlib.machinery.ModuleSpec | None:
        new = MOVED_MODULES.get(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _MovedLoader(fullname, new))


def install() -> None:
    """Put the finder on ``sys.meta_path`` once."""
    if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())
