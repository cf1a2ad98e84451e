"""The ``qkmap`` command: every subcommand is listed and parses its own help."""

from __future__ import annotations

import subprocess
import sys

import pytest

from qkmap_hf.cli import COMMANDS, build_parser


@pytest.mark.slow
def test_help_lists_every_subcommand():
    result = subprocess.run([sys.executable, "-m", "qkmap_hf", "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    for name in COMMANDS:
        assert f"    {name} " in result.stdout or f"    {name}\n" in result.stdout, name


@pytest.mark.parametrize("name", [n for n in COMMANDS if n != "eval"])  # eval hands --help to lm-eval's CLI
def test_each_subcommand_has_help(name, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([name, "--help"])
    assert exit_info.value.code == 0
    assert "usage: qkmap " + name in capsys.readouterr().out
