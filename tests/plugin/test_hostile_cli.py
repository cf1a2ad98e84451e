"""Hostile inputs at the command line: every refusal is one named line with exit code 2 and no traceback
(``--debug`` / ``QKMAP_DEBUG`` show it), missing paths are named as such, OS faults (a full disk) are explained,
and the hand-written README.md of a model folder survives ``qkmap card``."""

from __future__ import annotations

import errno
import shutil
import subprocess
import sys

import pytest

from qkmap_hf import cards
from qkmap_hf.cards import GENERATED_MARKER, template_path
from tests.hostile import assert_refused, run_cli, tree_digest
from tests.utils import tiny_config_kwargs


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A saved tiny QK-MAP checkpoint (config and weights are all `qkmap card` needs)."""
    from qkmap_hf import QKMapConfig, QKMapForCausalLM

    folder = tmp_path_factory.mktemp("card") / "tiny-qkmap"
    QKMapForCausalLM(QKMapConfig(**tiny_config_kwargs())).save_pretrained(folder)
    return folder


@pytest.mark.parametrize(
    "argv, named",
    [
        (["verify", "{tmp}/no-src", "{tmp}", "--text", "{tmp}/t.txt"], "SRC {tmp}/no-src: no such checkpoint folder"),
        (["verify", "{tmp}", "{tmp}/no-dst", "--text", "{tmp}/t.txt"], "DST {tmp}/no-dst: no such checkpoint folder"),
        (["analyze", "./no-model", "--output-dir", "{tmp}/out"], "MODEL ./no-model: no such checkpoint folder"),
        (
            ["analyze", "{tmp}", "--text", "{tmp}/none.txt", "--output-dir", "{tmp}/out"],
            "--text {tmp}/none.txt: no such",
        ),
        (["card", "{tmp}/no-model"], "MODEL {tmp}/no-model: no such checkpoint folder"),
        (["card", "{tmp}", "--eval-results", "{tmp}/none.json"], "--eval-results {tmp}/none.json: no such"),
        (
            ["train", "--model", "{tmp}/no-model", "--data", "{tmp}/t.txt", "--output-dir", "{tmp}/o"],
            "--model {tmp}/no-model: no such",
        ),
        (
            ["train", "--model", "tiny", "--data", "{tmp}/t.txt", "{tmp}/gone.txt", "--output-dir", "{tmp}/o"],
            "--data {tmp}/gone.txt: no such",
        ),
        (
            ["train", "--model", "tiny", "--data", "{tmp}/t.txt", "--tokenizer", "/no/tok", "--output-dir", "{tmp}/o"],
            "--tokenizer /no/tok: no such",
        ),
        (
            ["train", "--model", "tiny", "--data", "{tmp}/t.txt", "--resume", "{tmp}/ckpt", "--output-dir", "{tmp}/o"],
            "--resume {tmp}/ckpt: no such",
        ),
        (["compare", "--data", "{tmp}/none.txt", "--output-dir", "{tmp}/o"], "--data {tmp}/none.txt: no such"),
        (["push", "{tmp}/no-model", "org/name", "--dry-run"], "MODEL {tmp}/no-model: no such checkpoint folder"),
        (["convert", "{tmp}/no-src", "{tmp}/dst"], "SRC {tmp}/no-src: no such folder"),
        (["eval", "{tmp}/no-model", "--tasks", "qkmap_next_line"], "MODEL {tmp}/no-model: no such checkpoint folder"),
    ],
    ids=lambda v: v[0] if isinstance(v, list) else None,
)
def test_missing_paths_are_named(argv, named, tmp_path, capsys):
    (tmp_path / "t.txt").write_text("To be, or not to be.\n" * 20)
    before = tree_digest(tmp_path)
    code, _, err = run_cli(capsys, *[a.format(tmp=tmp_path) for a in argv])
    assert_refused(code, err, named.format(tmp=tmp_path))
    assert tree_digest(tmp_path) == before  # nothing written: no output folder, no checkpoint


def test_debug_flag_and_environment_show_the_traceback(tmp_path, capsys, monkeypatch):
    argv = ["card", str(tmp_path / "missing")]
    code, _, err = run_cli(capsys, *argv)
    assert code == 2 and "Traceback" not in err and "--debug" in err
    code, _, err = run_cli(capsys, "--debug", *argv)
    assert code == 2 and "Traceback (most recent call last)" in err and "FileNotFoundError" in err
    code, _, err = run_cli(capsys, *argv, "--debug")  # after the command as well
    assert code == 2 and "Traceback (most recent call last)" in err
    monkeypatch.setenv("QKMAP_DEBUG", "1")
    code, _, err = run_cli(capsys, *argv)
    assert code == 2 and "Traceback (most recent call last)" in err


def test_full_disk_is_one_line_and_the_old_card_survives(model_dir, tmp_path, capsys, monkeypatch):
    folder = tmp_path / "model"
    shutil.copytree(model_dir, folder)
    assert run_cli(capsys, "card", folder)[0] == 0
    before = tree_digest(folder)

    def full_disk(path, text):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(cards, "atomic_write_text", full_disk)
    code, _, err = run_cli(capsys, "card", folder, "--license", "mit")
    assert_refused(code, err, f"{folder / 'README.md'}: No space left on device", "free some disk space")
    assert tree_digest(folder) == before


def test_ctrl_c_is_exit_130_without_traceback(tmp_path, capsys, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cards, "write_model_card", interrupted)
    (tmp_path / "config.json").write_text("{}")
    code, _, err = run_cli(capsys, "card", tmp_path)
    assert code == 130 and "interrupted" in err and "Traceback" not in err


def test_card_keeps_a_hand_written_readme(model_dir, tmp_path, capsys):
    folder = tmp_path / "model"
    shutil.copytree(model_dir, folder)
    (folder / "README.md").write_text("# My notes\n\nHand-written; months of work.\n")
    before = tree_digest(folder)
    code, _, err = run_cli(capsys, "card", folder)
    assert_refused(code, err, f"{folder / 'README.md'} was not written by qkmap card", "--overwrite")
    assert tree_digest(folder) == before
    # with --overwrite the user named it: replaced by a card, which later runs may regenerate freely
    assert run_cli(capsys, "card", folder, "--overwrite")[0] == 0
    card = (folder / "README.md").read_text()
    assert GENERATED_MARKER in card and "Hand-written" not in card
    assert run_cli(capsys, "card", folder, "--license", "mit")[0] == 0
    assert "license: mit" in (folder / "README.md").read_text()


def test_card_template_carries_the_generated_marker():
    """The README guard recognises our cards by this template line; a template edit must keep it."""
    assert GENERATED_MARKER in template_path().read_text()


@pytest.mark.slow
def test_console_entry_point_prints_one_line(tmp_path):
    """`python -m qkmap_hf` in a fresh interpreter: the same one line, exit code 2, no traceback."""
    result = subprocess.run(
        [sys.executable, "-m", "qkmap_hf", "verify", str(tmp_path / "nope"), str(tmp_path), "--text", "x"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"SRC {tmp_path / 'nope'}: no such checkpoint folder" in result.stderr


@pytest.mark.parametrize(
    "argv, named",
    [
        (["compare", "--data", "{tmp}/t.txt", "--output-dir", "{tmp}/o", "--block-size", "0"], "--block-size 0"),
        (["compare", "--data", "{tmp}/t.txt", "--output-dir", "{tmp}/o", "--steps", "0"], "--steps 0"),
        (["convert", "{tmp}/src", "{tmp}/o", "--num-frequencies", "0"], "num_frequencies=0 is invalid"),
        (["convert", "{tmp}/src", "{tmp}/o", "--omega0", "nan"], "omega0=nan is invalid"),
    ],
    ids=lambda v: v[0] if isinstance(v, list) else None,
)
def test_zero_and_nan_counts_are_refused_not_defaulted(argv, named, model_dir, tmp_path, capsys):
    (tmp_path / "t.txt").write_text("To be, or not to be.\n" * 20)
    shutil.copytree(model_dir, tmp_path / "src")
    before = tree_digest(tmp_path)
    code, _, err = run_cli(capsys, *[a.format(tmp=tmp_path) for a in argv])
    assert_refused(code, err, named)
    assert tree_digest(tmp_path) == before
