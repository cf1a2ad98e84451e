"""Hostile conversions: --overwrite never replaces the working folder, a parent of the source or a folder that
is not a model's; a conversion whose verification yields NaN/inf fails and leaves no DST; SRC is never touched."""

from __future__ import annotations

import math

import torch
from safetensors.torch import load_file, save_file

from qkmap_hf.verify import VerificationReport
from tests.hostile import assert_refused, run_cli, tree_digest


def test_overwrite_never_replaces_the_working_folder(src, tmp_path, capsys, monkeypatch):
    work = tmp_path / "work"
    (work / "sub").mkdir(parents=True)
    (work / "notes.txt").write_text("my notes")
    (work / "model.safetensors").write_bytes(b"looks like a model folder, still the working folder")
    before = tree_digest(work, src)
    monkeypatch.chdir(work)
    code, _, err = run_cli(capsys, "convert", src, ".", "--overwrite", "--no-progress")
    assert_refused(code, err, "is the working folder or a parent of it")
    monkeypatch.chdir(work / "sub")
    code, _, err = run_cli(capsys, "convert", src, "..", "--overwrite", "--no-progress")
    assert_refused(code, err, "is the working folder or a parent of it")
    assert tree_digest(work, src) == before


def test_overwrite_never_replaces_a_parent_of_the_source(src, tmp_path, capsys):
    (tmp_path / "models" / "other.txt").write_text("another project")
    before = tree_digest(tmp_path)
    code, _, err = run_cli(capsys, "convert", src, tmp_path / "models", "--overwrite", "--no-progress")
    assert_refused(code, err, "overlaps SRC")
    assert tree_digest(tmp_path) == before


def test_overwrite_never_replaces_a_folder_that_is_not_a_model(src, tmp_path, capsys):
    photos = tmp_path / "photos"
    photos.mkdir()
    (photos / "holiday.jpg").write_bytes(bytes(range(256)))
    before = tree_digest(tmp_path)
    code, _, err = run_cli(capsys, "convert", src, photos, "--overwrite", "--no-progress")
    assert_refused(code, err, f"DST {photos} is not empty and is not a model folder")
    assert tree_digest(tmp_path) == before


def test_unrepresentable_omega0_is_refused_before_writing(src, tmp_path, capsys):
    before = tree_digest(tmp_path)
    code, _, err = run_cli(capsys, "convert", src, tmp_path / "out", "--omega0", "1e-50", "--no-progress")
    assert_refused(code, err, "omega0=1e-50 (--omega0)", "magnitude")
    assert tree_digest(tmp_path) == before and not (tmp_path / "out").exists()


def test_report_flags_non_finite_numbers():
    report = VerificationReport("a", "b", 8, 3.0, math.nan, math.nan, math.inf, 1.0, 4, 4, None)
    assert report.non_finite() == ["converted_perplexity", "mean_kl", "max_kl"]
    assert report.to_dict()["non_finite"] == report.non_finite()
    assert "NON-FINITE (NaN/inf) numbers" in report.table()
    assert VerificationReport("a", "b", 8, 3.0, 3.0, 0.0, 0.0, 0.0, 4, 4, None).non_finite() == []


def test_nan_weights_fail_the_verified_conversion_and_leave_no_dst(src, tmp_path, capsys):
    """A source with a NaN weight converts to NaN logits; --verify measures them and the conversion fails."""
    weights = load_file(src / "model.safetensors")
    weights["model.layers.0.self_attn.o_proj.weight"][0, 0] = torch.nan
    save_file(weights, src / "model.safetensors", metadata={"format": "pt"})
    text = tmp_path / "text.txt"
    text.write_text("Full fathom five thy father lies; of his bones are coral made.\n" * 8)
    before = tree_digest(tmp_path)
    dst = tmp_path / "out"
    code, out, err = run_cli(capsys, "convert", src, dst, "--verify", text, "--max-tokens", "32", "--no-progress")
    assert_refused(code, err, f"verifying {dst} gave non-finite", "perplexity")
    assert not dst.exists() and not list(tmp_path.glob(".out.*"))
    assert tree_digest(tmp_path) == before
