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


def test_a_command_run_as_its_own_program_reports_through_cli_main(tmp_path, capsys):
    from qkmap_hf.commands import convert

    argv = [str(tmp_path / "src"), str(tmp_path / "dst"), "--verify", str(tmp_path / "none.txt")]
    assert convert.main(argv, prog="convert_llama_to_qkmap.py") == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == f"convert_llama_to_qkmap.py: error: --verify {tmp_path / 'none.txt'}: no such text file."
    assert not (tmp_path / "dst").exists()
