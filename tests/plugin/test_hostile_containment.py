"""Hostile containment: a path named inside a file (an index's ``weight_map``, an analysis plot) or a symlink in
SRC never makes a command read, copy or write a file outside the folders it was given; the Hugging Face cache's
snapshot -> blob links are followed only into the blobs of the same cache entry."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from safetensors.torch import load_file, save_file

from qkmap_hf import QKMapConfig, QKMapForCausalLM
from qkmap_hf.cards import write_model_card
from qkmap_hf.hub import validate_for_push
from qkmap_hf.safety import contained_path, escape_reason
from tests.hostile import assert_refused, run_cli, tree_digest
from tests.utils import tiny_config_kwargs

SECRET = b"api_key = hunter2\n"


def _shard(src, outside_entry: str) -> None:
    """Split SRC's weights into two shards; the index places one tensor's shard at ``outside_entry``."""
    weights = load_file(src / "model.safetensors")
    names = sorted(weights)
    save_file({n: weights[n] for n in names[:3]}, src / "model-00001-of-00002.safetensors", metadata={"format": "pt"})
    save_file({n: weights[n] for n in names[3:]}, src / "model-00002-of-00002.safetensors", metadata={"format": "pt"})
    (src / "model.safetensors").unlink()
    weight_map = {n: "model-00001-of-00002.safetensors" for n in names[:3]}
    weight_map.update({n: "model-00002-of-00002.safetensors" for n in names[3:]})
    weight_map[names[0]] = outside_entry
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize("entry", ["../victim.safetensors", "ABSOLUTE", "sub/../../victim.safetensors"])
def test_index_entries_outside_src_are_refused(entry, src, tmp_path, capsys):
    victim = tmp_path / "models" / "victim.safetensors"
    shutil.copy(src / "model.safetensors", victim)  # a real shard: read as one, then truncated and rewritten
    entry = str(victim) if entry == "ABSOLUTE" else entry
    _shard(src, entry)
    (tmp_path / "secret.txt").write_bytes(SECRET)
    before = tree_digest(tmp_path)
    code, _, err = run_cli(capsys, "convert", src, tmp_path / "out" / "dst", "--no-progress")
    assert_refused(code, err, str(src / "model.safetensors.index.json"), repr(entry), "inside")
    assert tree_digest(tmp_path) == before
    assert not (tmp_path / "out").exists()


def test_a_symlinked_shard_leaving_src_is_refused(src, tmp_path, capsys):
    victim = tmp_path / "elsewhere.safetensors"
    (src / "model.safetensors").rename(victim)
    (src / "model.safetensors").symlink_to(victim)
    before = tree_digest(tmp_path)
    code, _, err = run_cli(capsys, "convert", src, tmp_path / "dst", "--no-progress")
    assert_refused(code, err, str(src / "model.safetensors"), "outside the folder")
    assert tree_digest(tmp_path) == before and not (tmp_path / "dst").exists()


def test_a_tokenizer_symlink_leaving_src_is_never_copied(src, tmp_path, capsys):
    secret = tmp_path / "secret.txt"
    secret.write_bytes(SECRET)
    (src / "tokenizer.json").unlink()
    (src / "tokenizer.json").symlink_to(secret)
    before = tree_digest(tmp_path)
    code, _, err = run_cli(capsys, "convert", src, tmp_path / "dst", "--no-progress")
    assert_refused(code, err, str(src / "tokenizer.json"), f"a symlink to {secret}", "outside the folder")
    assert tree_digest(tmp_path) == before and not (tmp_path / "dst").exists()
    assert secret.read_bytes() == SECRET


def test_hf_cache_snapshot_links_into_its_own_blobs_are_followed(pristine_llama, tmp_path, capsys):
    """The cache layout (snapshots/REV/NAME -> ../../blobs/HASH) converts; the copies in DST are plain files."""
    entry = tmp_path / "hub" / "models--org--tiny"
    blobs, snapshot = entry / "blobs", entry / "snapshots" / "0123abcd"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for number, path in enumerate(sorted(pristine_llama.iterdir())):
        shutil.copy(path, blobs / f"blob{number}")
        (snapshot / path.name).symlink_to(os.path.relpath(blobs / f"blob{number}", snapshot))
    code, _, err = run_cli(capsys, "convert", snapshot, tmp_path / "dst", "--no-progress")
    assert code == 0, err
    copied = tmp_path / "dst" / "tokenizer.json"
    assert not copied.is_symlink() and copied.read_bytes() == (pristine_llama / "tokenizer.json").read_bytes()
    # a link from that snapshot into another cache entry's blobs is not the same cache entry
    other = tmp_path / "hub" / "models--evil--x" / "blobs"
    other.mkdir(parents=True)
    (other / "secret").write_bytes(SECRET)
    assert escape_reason(snapshot, "tokenizer.json") is None
    (snapshot / "tokenizer.json").unlink()
    (snapshot / "tokenizer.json").symlink_to(os.path.relpath(other / "secret", snapshot))
    assert "outside the folder" in escape_reason(snapshot, "tokenizer.json")


@pytest.mark.parametrize("entry", ["../secret.txt", "/etc/hostname", "plots/../../secret.txt", "", 7])
def test_contained_path_names_the_file_and_the_entry(entry, tmp_path):
    with pytest.raises(ValueError) as error:
        contained_path(tmp_path / "folder", entry, source="index.json", what="entry")
    assert str(error.value).startswith("index.json: entry ") and repr(entry) in str(error.value)
    assert contained_path(tmp_path, "a/b.png", source="x", what="y") == tmp_path / "a" / "b.png"


@pytest.fixture
def qkmap_folder(tmp_path):
    folder = tmp_path / "tiny"
    QKMapForCausalLM(QKMapConfig(**tiny_config_kwargs())).save_pretrained(folder)
    write_model_card(folder)
    return folder


@pytest.mark.parametrize("plot", ["../secret.txt", "ABSOLUTE", "link.png"])
def test_card_never_copies_a_plot_from_outside_the_analysis_folder(plot, qkmap_folder, tmp_path, capsys):
    secret = tmp_path / "secret.txt"
    secret.write_bytes(SECRET)
    analysis = tmp_path / "analysis"
    analysis.mkdir()
    (analysis / "link.png").symlink_to(secret)
    plot = str(secret) if plot == "ABSOLUTE" else plot
    document = {"format": "qkmap-analysis/1", "models": [{"label": "tiny", "plots": {"scale_sensitivity": plot}}]}
    (analysis / "analysis.json").write_text(json.dumps(document))
    before = tree_digest(tmp_path)
    code, _, err = run_cli(capsys, "card", qkmap_folder, "--analysis", analysis)
    assert_refused(code, err, str(analysis / "analysis.json"), repr(plot), "inside")
    assert tree_digest(tmp_path) == before
    assert not (qkmap_folder / "analysis").exists()


def test_push_validation_names_index_entries_outside_the_folder(qkmap_folder, tmp_path):
    (tmp_path / "victim.safetensors").write_bytes(b"x")
    index = {"metadata": {}, "weight_map": {"lm_head.weight": "../victim.safetensors"}}
    (qkmap_folder / "model.safetensors.index.json").write_text(json.dumps(index))
    problems = validate_for_push(qkmap_folder, load_check=False)
    assert any("names shards outside the folder: '../victim.safetensors'" in p for p in problems), problems
