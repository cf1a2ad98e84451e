"""The lab's commands: ``qkmap-lab`` lists and runs its reports, and a sweep recorded in docs/results still parses
into the report committed beside it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from qkmap_lab.cli import COMMANDS, main

REPO = Path(__file__).resolve().parents[2]
RECORDED_SWEEP = REPO / "docs" / "results" / "stability" / "sweep"


def test_usage_lists_every_command_and_an_unknown_one_is_refused_in_one_line(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in COMMANDS)
    assert main(["stabilty"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "unknown command 'stabilty'" in err and "stability" in err


def test_every_command_is_a_module_with_a_main():
    from importlib import import_module

    for module, _ in COMMANDS.values():
        assert callable(import_module(module).main)


def test_a_recorded_sweep_parses_into_the_report_committed_beside_it(tmp_path):
    """The lab's stability report, rebuilt from the recorded sweep's CSVs, equals the committed stability.json."""
    from qkmap_lab.stability import build_report

    rebuilt = build_report(RECORDED_SWEEP, tmp_path / "report")
    committed = json.loads((RECORDED_SWEEP.parent / "report" / "stability.json").read_text())
    assert json.loads(json.dumps(rebuilt)) == committed
    assert committed["arms"]["qk_map"]["loss_by_lr"], "the committed report has no losses"


@pytest.mark.slow
def test_the_entry_point_and_python_m_run_the_same_command(tmp_path):
    for command in (["qkmap-lab", "stability", "--help"], [sys.executable, "-m", "qkmap_lab", "stability", "--help"]):
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert "usage: qkmap-lab stability" in done.stdout
