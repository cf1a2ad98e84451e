"""The conversion's plumbing on real bytes: the adapter hook's splits and merges, and the streaming writer.

- A family whose checkpoint fuses q/k/v into one tensor (one-to-many) and splits the embedding across two
  shards (many-to-one) joins as one small adapter and converts to the same tensors as plain Llama.
- The writer's output is byte-identical to the written-out safetensors layout (header, alignment order,
  raw bytes), whether a tensor is copied file to file or written from memory, and a crash mid-write
  leaves no complete-looking output.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from qkmap_hf.conversion import ADAPTERS, ArchitectureAdapter, OutputTensor
from qkmap_hf.conversion import writer as conversion_writer
from qkmap_hf.conversion.plan import PlannedTensor
from qkmap_hf.conversion.sources import SAFETENSORS_DTYPES, SafetensorsSource
from qkmap_hf.packaging import convert_checkpoint
from tests.utils import tiny_config_kwargs


class FusedLlamaAdapter(ArchitectureAdapter):
    """A made-up family: q/k/v fused into ``qkv_proj``, the embedding saved as two halves."""

    refused_tensor_markers = {}

    def tensor_outputs(self, name, config):
        if name.endswith(".self_attn.qkv_proj.weight"):
            prefix = name.removesuffix("qkv_proj.weight")
            q = config.num_attention_heads * config.head_dim
            kv = config.num_key_value_heads * config.head_dim
            for part, start, size in (("q", 0, q), ("k", q, kv), ("v", q + kv, kv)):
                yield OutputTensor(f"{prefix}{part}_proj.weight", (name,), lambda w, s=start, n=size: w[s : s + n])
        elif name.startswith("model.embed_tokens.half"):
            halves = ("model.embed_tokens.half0", "model.embed_tokens.half1")
            yield OutputTensor("model.embed_tokens.weight", halves, lambda a, b: torch.cat([a, b]))
        else:
            yield from super().tensor_outputs(name, config)


def tensors_of(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(file))
    return out


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**tiny_config_kwargs(initializer_range=0.1)))
    model.save_pretrained(root / "src", max_shard_size="60KB")
    convert_checkpoint(root / "src", root / "dst", progress=False)
    return {"model": model, "src": root / "src", "dst": root / "dst", "root": root}


def test_adapter_splits_and_merges_tensors(llama, tmp_path, monkeypatch):
    monkeypatch.setitem(ADAPTERS, "FusedLlamaForCausalLM", FusedLlamaAdapter)
    state = {name: tensor.clone() for name, tensor in llama["model"].state_dict().items()}
    src = tmp_path / "fused"
    src.mkdir()
    first, second = {}, {}
    embedding = state.pop("model.embed_tokens.weight")
    first["model.embed_tokens.half0"], second["model.embed_tokens.half1"] = embedding[:100], embedding[100:]
    for layer in range(2):
        prefix = f"model.layers.{layer}.self_attn."
        parts = [state.pop(f"{prefix}{p}_proj.weight") for p in "qkv"]
        (first if layer == 0 else second)[f"{prefix}qkv_proj.weight"] = torch.cat(parts)
    for number, (name, tensor) in enumerate(state.items()):
        (first if number % 2 else second)[name] = tensor
    save_file({k: v.contiguous() for k, v in first.items()}, src / "a.safetensors", metadata={"format": "pt"})
    save_file({k: v.contiguous() for k, v in second.items()}, src / "b.safetensors", metadata={"format": "pt"})
    weight_map = {**dict.fromkeys(first, "a.safetensors"), **dict.fromkeys(second, "b.safetensors")}
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = llama["model"].config.to_dict()
    config["architectures"] = ["FusedLlamaForCausalLM"]
    (src / "config.json").write_text(json.dumps(config))
    convert_checkpoint(src, tmp_path / "dst", progress=False)
    converted, reference = tensors_of(tmp_path / "dst"), tensors_of(llama["dst"])
    assert converted.keys() == reference.keys()
    assert all(torch.equal(converted[name], reference[name]) for name in reference)
    # the merged embedding sits in the shard of its first source, the split q/k/v in their source's shard
    index = json.loads((tmp_path / "dst" / "model.safetensors.index.json").read_text())["weight_map"]
    assert index["model.embed_tokens.weight"] == "a.safetensors"
    assert index["model.layers.1.self_attn.k_proj.weight"] == "b.safetensors"


def reference_safetensors(tensors: list[tuple[str, torch.Tensor]]) -> bytes:
    """The safetensors layout written out: 8-byte length, JSON header padded to 8, data largest itemsize first."""
    order = sorted(tensors, key=lambda item: -item[1].element_size())
    header, offset, data = {"__metadata__": {"format": "pt"}}, 0, b""
    for name, tensor in order:
        raw = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + len(raw)],
        }
        offset, data = offset + len(raw), data + raw
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    return struct.pack("<Q", len(encoded)) + encoded + data


def write_shards(source: SafetensorsSource, out_dir: Path, cast: dict[str, torch.dtype]) -> dict[str, bytes]:
    """Stream every shard of ``source`` through the writer: unchanged tensors as file spans, cast ones as tensors."""
    out = {}
    for shard, infos in source.shards:
        planned = [
            PlannedTensor(name, info.shape, cast.get(name, info.dtype), (name,), unchanged=name not in cast)
            for name, info in infos.items()
        ]
        with source.open(shard) as read:

            def produce(p, read=read):
                return read.span(p.name) if p.unchanged else read(p.name).to(p.dtype)

            conversion_writer.write_safetensors_streaming(out_dir / shard, planned, produce)
        out[shard] = (out_dir / shard).read_bytes()
    return out


@pytest.mark.parametrize("kernel_copy", [True, False], ids=["copy_file_range", "pread-pwrite"])
def test_streaming_writer_is_byte_identical(llama, tmp_path, monkeypatch, kernel_copy):
    if not kernel_copy:

        def unsupported(*args, **kwargs):
            raise OSError(errno.EXDEV, "cross-device")

        monkeypatch.setattr(os, "copy_file_range", unsupported)
    source = SafetensorsSource(llama["src"])
    cast = {"model.layers.0.mlp.up_proj.weight": torch.bfloat16, "model.norm.weight": torch.float16}
    written = write_shards(source, tmp_path, cast)
    for shard, infos in source.shards:
        originals = load_file(llama["src"] / shard)
        expected = reference_safetensors([(n, originals[n].to(cast.get(n, originals[n].dtype))) for n in infos])
        digest = hashlib.sha256(written[shard]).hexdigest()
        assert digest == hashlib.sha256(expected).hexdigest(), shard
    mixed = {"a": torch.randn(3, 5).double(), "b": torch.arange(7, dtype=torch.int32), "c": torch.randn(9).half()}
    save_file(mixed, tmp_path / "mixed.safetensors", metadata={"format": "pt"})
    (tmp_path / "src").mkdir()
    os.replace(tmp_path / "mixed.safetensors", tmp_path / "src" / "model.safetensors")
    assert write_shards(SafetensorsSource(tmp_path / "src"), tmp_path, {}) == {
        "model.safetensors": (tmp_path / "src" / "model.safetensors").read_bytes()
    }


def test_crash_mid_write_leaves_no_complete_looking_output(llama, tmp_path, monkeypatch):
    """A disk error in the middle of a shard: the partial file is shorter than its header says, and no DST appears."""
    calls = {"n": 0}
    original = conversion_writer._copy_span

    def failing(span, fd, offset):
        calls["n"] += 1
        if calls["n"] == 5:
            original(type(span)(span.fd, span.offset, span.nbytes // 2), fd, offset)
            raise OSError(errno.ENOSPC, "No space left on device (simulated)")
        original(span, fd, offset)

    monkeypatch.setattr(conversion_writer, "_copy_span", failing)
    dst = tmp_path / "dst"
    with pytest.raises(OSError, match="simulated"):
        convert_checkpoint(llama["src"], dst, progress=False)
    assert calls["n"] == 5
    assert not dst.exists() and not list(tmp_path.glob(".dst.*"))

    # the same failure on a bare file: safetensors refuses the half-written result as truncated
    llama["model"].save_pretrained(tmp_path / "single")
    source = SafetensorsSource(tmp_path / "single")
    shard, infos = source.shards[0]
    planned = [PlannedTensor(n, i.shape, i.dtype, (n,), unchanged=True) for n, i in infos.items()]
    calls["n"] = 0
    with source.open(shard) as read, pytest.raises(OSError):
        conversion_writer.write_safetensors_streaming(
            tmp_path / "partial.safetensors", planned, lambda p: read.span(p.name)
        )
    length = struct.unpack("<Q", (tmp_path / "partial.safetensors").read_bytes()[:8])[0]
    header = json.loads((tmp_path / "partial.safetensors").read_bytes()[8 : 8 + length])
    planned_size = 8 + length + max(entry["data_offsets"][1] for k, entry in header.items() if k != "__metadata__")
    assert (tmp_path / "partial.safetensors").stat().st_size < planned_size
    with pytest.raises(Exception, match="(?i)incomplete|truncat|invalid|size"):
        load_file(tmp_path / "partial.safetensors")
