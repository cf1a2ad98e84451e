"""Bad inputs: each gets an error naming the file or field, leaves no DST (nor a temporary folder) and never
modifies SRC."""

from __future__ import annotations

import hashlib
import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from qkmap_hf.conversion import ConversionError
from qkmap_hf.conversion import plan as conversion_plan
from qkmap_hf.packaging import convert_checkpoint
from tests.utils import tiny_config_kwargs

SUPPORTED = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> dict[str, Path]:
    """One sharded and one single-file tiny Llama, saved once; tests work on copies."""
    root = tmp_path_factory.mktemp("pristine")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**tiny_config_kwargs()))
    model.save_pretrained(root / "sharded", max_shard_size="60KB")
    model.save_pretrained(root / "single")
    return {"sharded": root / "sharded", "single": root / "single"}


def folder_hash(folder: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(folder.rglob("*")):
        digest.update(str(path.relative_to(folder)).encode())
        if path.is_file():
            digest.update(path.read_bytes())
    return digest.hexdigest()


def copy_source(pristine: dict[str, Path], tmp_path: Path, kind: str = "sharded") -> Path:
    src = tmp_path / "src"
    shutil.copytree(pristine[kind], src)
    return src


def expect_failure(src, dst: Path, *fragments: str, error: type[BaseException] = ConversionError, **kwargs) -> str:
    """Convert, expect ``error`` whose message contains every fragment; check no DST, no temp folder, SRC intact."""
    src_path = Path(src)
    before = folder_hash(src_path) if src_path.is_dir() else None
    with pytest.raises(error) as info:
        convert_checkpoint(src, dst, progress=False, **kwargs)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in: {message}"
    assert not dst.exists(), "a DST was left behind"
    assert not list(dst.parent.glob(f".{dst.name}.*")), "a temporary folder was left behind"
    if before is not None:
        assert folder_hash(src_path) == before, "SRC was modified"
    return message


def test_pickle_checkpoint_refused_without_unpickling(tmp_path, monkeypatch):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(LlamaConfig(**tiny_config_kwargs()).to_json_string())
    torch.save({"model.embed_tokens.weight": torch.zeros(2, 2)}, src / "pytorch_model.bin")

    def forbidden(*args, **kwargs):
        raise AssertionError("conversion tried to unpickle")

    monkeypatch.setattr(torch, "load", forbidden)
    monkeypatch.setattr(pickle, "load", forbidden)
    monkeypatch.setattr(pickle, "loads", forbidden)
    expect_failure(src, tmp_path / "dst", "pytorch_model.bin", "pickle", "safetensors")
    expect_failure(src / "pytorch_model.bin", tmp_path / "dst", "pickle")


def test_renamed_pickle_found_by_content(pristine, tmp_path, monkeypatch):
    """A pickle under an innocent name is still refused: as the only weights, and as a side file to copy."""
    monkeypatch.setattr(pickle, "load", lambda *a, **k: pytest.fail("conversion tried to unpickle"))
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(LlamaConfig(**tiny_config_kwargs()).to_json_string())
    torch.save({"model.embed_tokens.weight": torch.zeros(2, 2)}, src / "weights.data")
    expect_failure(src, tmp_path / "dst", "weights.data", "pickle")

    src = copy_source(pristine, tmp_path / "second")
    (src / "tokenizer.model").write_bytes(pickle.dumps({"not": "a tokenizer"}))
    expect_failure(src, tmp_path / "dst2", "tokenizer.model", "pickle")


def test_missing_config(pristine, tmp_path):
    src = copy_source(pristine, tmp_path)
    (src / "config.json").unlink()
    expect_failure(src, tmp_path / "dst", "config.json is missing", str(src / "config.json"))


def test_corrupt_safetensors_header(pristine, tmp_path):
    src = copy_source(pristine, tmp_path)
    shard = sorted(src.glob("*.safetensors"))[1]
    data = bytearray(shard.read_bytes())
    data[8:40] = b"\x00garbage, not a JSON header!!!\xff"
    shard.write_bytes(bytes(data))
    expect_failure(src, tmp_path / "dst", shard.name, "corrupt or truncated")


def test_truncated_safetensors(pristine, tmp_path):
    src = copy_source(pristine, tmp_path, "single")
    shard = src / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1000])
    expect_failure(src, tmp_path / "dst", "model.safetensors", "corrupt or truncated")


def test_missing_shard(pristine, tmp_path):
    src = copy_source(pristine, tmp_path)
    shard = sorted(src.glob("*.safetensors"))[-1]
    shard.unlink()
    expect_failure(src, tmp_path / "dst", shard.name, "missing", "model.safetensors.index.json")


def test_index_that_does_not_match_its_shards(pristine, tmp_path):
    src = copy_source(pristine, tmp_path)
    index_path = src / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name = "model.layers.1.mlp.up_proj.weight"
    other = next(f for f in sorted(set(index["weight_map"].values())) if f != index["weight_map"][name])
    index["weight_map"][name] = other
    index_path.write_text(json.dumps(index))
    expect_failure(src, tmp_path / "dst", name, other, "index")


def test_head_count_that_does_not_divide(pristine, tmp_path):
    src = copy_source(pristine, tmp_path)
    config = json.loads((src / "config.json").read_text())
    config["num_key_value_heads"] = 3
    (src / "config.json").write_text(json.dumps(config))
    expect_failure(src, tmp_path / "dst", "num_attention_heads=4", "num_key_value_heads=3", "config.json")


def test_missing_config_field(pristine, tmp_path):
    src = copy_source(pristine, tmp_path)
    config = json.loads((src / "config.json").read_text())
    del config["num_hidden_layers"]
    (src / "config.json").write_text(json.dumps(config))
    expect_failure(src, tmp_path / "dst", "'num_hidden_layers'", "config.json")


def test_config_that_does_not_match_the_weights(pristine, tmp_path):
    src = copy_source(pristine, tmp_path, "single")
    config = json.loads((src / "config.json").read_text())
    config["intermediate_size"] = 96
    (src / "config.json").write_text(json.dumps(config))
    expect_failure(src, tmp_path / "dst", "mlp.", "shape", "config.json")


@pytest.mark.parametrize(
    ("architecture", "reason"),
    [
        ("Olmo2ForCausalLM", "normalizes queries and keys"),
        ("Phi3ForCausalLM", "fused"),
        ("MixtralForCausalLM", "mixture-of-experts"),
        ("FancyNewForCausalLM", "cannot be converted"),
    ],
)
def test_unsupported_architecture_refused(pristine, tmp_path, architecture, reason):
    src = copy_source(pristine, tmp_path, "single")
    config = json.loads((src / "config.json").read_text())
    config["architectures"] = [architecture]
    (src / "config.json").write_text(json.dumps(config))
    message = expect_failure(src, tmp_path / "dst", architecture, reason)
    assert all(name in message for name in SUPPORTED)


def test_existing_q_norm_tensors_refused(pristine, tmp_path):
    """A checkpoint that says Llama but carries q/k norms (a different attention) is refused by tensor name."""
    src = copy_source(pristine, tmp_path, "single")
    save_file({"model.layers.0.self_attn.q_norm.weight": torch.ones(16)}, src / "extra.safetensors")
    index = {"metadata": {}, "weight_map": {"model.layers.0.self_attn.q_norm.weight": "extra.safetensors"}}
    from safetensors import safe_open

    with safe_open(str(src / "model.safetensors"), framework="pt") as handle:
        index["weight_map"].update({name: "model.safetensors" for name in handle.keys()})  # noqa: SIM118
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    expect_failure(src, tmp_path / "dst", "q_norm", "LlamaForCausalLM")


def test_sliding_window_mistral_refused(tmp_path):
    src = tmp_path / "src"
    MistralForCausalLM(MistralConfig(**tiny_config_kwargs(sliding_window=32))).save_pretrained(src)
    expect_failure(src, tmp_path / "dst", "MistralForCausalLM", "sliding_window=32")


def test_sliding_window_qwen2_refused(tmp_path):
    src = tmp_path / "src"
    config = Qwen2Config(**tiny_config_kwargs(use_sliding_window=True, sliding_window=32, max_window_layers=1))
    Qwen2ForCausalLM(config).save_pretrained(src)
    expect_failure(src, tmp_path / "dst", "Qwen2ForCausalLM", "sliding_window=32", "layers [1]")


def test_repo_id_not_in_local_cache(tmp_path):
    expect_failure(
        "no-such-org/no-such-model", tmp_path / "dst", "no-such-org/no-such-model", "local Hugging Face cache"
    )


def test_repo_id_resolved_from_local_cache(pristine, tmp_path):
    """A repo id that is in the local cache converts offline; base_model in provenance and card is the repo id."""
    cache = tmp_path / "hub"
    snapshot = cache / "models--tiny-org--tiny-llama" / "snapshots" / "0123abcd"
    shutil.copytree(pristine["single"], snapshot)
    (cache / "models--tiny-org--tiny-llama" / "refs").mkdir()
    (cache / "models--tiny-org--tiny-llama" / "refs" / "main").write_text("0123abcd")
    dst = tmp_path / "dst"
    convert_checkpoint("tiny-org/tiny-llama", dst, progress=False, cache_dir=cache)
    provenance = json.loads((dst / "qkmap_conversion.json").read_text())
    assert provenance["source"] == "tiny-org/tiny-llama" and provenance["base_model"] == "tiny-org/tiny-llama"
    assert "base_model: tiny-org/tiny-llama" in (dst / "README.md").read_text()


def test_bad_options(pristine, tmp_path):
    src = copy_source(pristine, tmp_path, "single")
    expect_failure(src, tmp_path / "dst", "init='fancy'", init="fancy")
    expect_failure(src, tmp_path / "dst", "omega0", omega0=-1.0)
    expect_failure(src, tmp_path / "dst", "num_frequencies", num_frequencies=0)
    expect_failure(src, tmp_path / "dst", "dtype", dtype="int8")
    expect_failure(src, src / "inside", "overlaps SRC")
    expect_failure(src, tmp_path / "dst", "no tokenizer files", "--verify", verify_text="To be, or not to be.")


def test_existing_destination_needs_overwrite(pristine, tmp_path):
    src = copy_source(pristine, tmp_path, "single")
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "precious.txt").write_text("keep me")
    with pytest.raises(ConversionError, match="not empty.*--overwrite"):
        convert_checkpoint(src, dst, progress=False)
    assert [p.name for p in dst.iterdir()] == ["precious.txt"]
    with pytest.raises(ValueError, match="not a model folder"):  # issue 13: --overwrite replaces only an output
        convert_checkpoint(src, dst, progress=False, overwrite=True)
    assert [p.name for p in dst.iterdir()] == ["precious.txt"]
    assert not list(tmp_path.glob(".dst.*"))
    empty = tmp_path / "empty"
    empty.mkdir()
    convert_checkpoint(src, empty, progress=False)  # an empty folder is fine without --overwrite
    assert (empty / "config.json").is_file()
    (empty / "stale.txt").write_text("from the old output")
    convert_checkpoint(src, empty, progress=False, overwrite=True)  # a previous output is replaced
    assert not (empty / "stale.txt").exists() and (empty / "model.safetensors").is_file()
    assert not list(tmp_path.glob(".empty.*"))


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, OSError])
def test_crash_midway_leaves_nothing_and_keeps_old_destination(pristine, tmp_path, monkeypatch, interrupt):
    """Ctrl-C (or a disk error) after some tensors were written: no DST, no temp folder; an old DST survives."""
    src = copy_source(pristine, tmp_path)
    original = conversion_plan.ConversionPlan.materialize
    calls = {"n": 0}

    def flaky(self, planned, read):
        calls["n"] += 1
        if calls["n"] == 12:
            raise interrupt("simulated crash")
        return original(self, planned, read)

    monkeypatch.setattr(conversion_plan.ConversionPlan, "materialize", flaky)
    expect_failure(src, tmp_path / "dst", "simulated crash", error=interrupt)
    old = tmp_path / "old"
    old.mkdir()
    (old / "model.safetensors").write_text("previous conversion")
    calls["n"] = 0
    with pytest.raises(interrupt):
        convert_checkpoint(src, old, progress=False, overwrite=True)
    assert [p.name for p in old.iterdir()] == ["model.safetensors"]
    assert (old / "model.safetensors").read_text() == "previous conversion"
    assert not list(tmp_path.glob(".old.*"))
