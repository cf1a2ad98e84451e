"""Helpers of the hostile-input suite (tests/test_hostile_*.py): run the CLI in this process and prove that a
refusal left every file as it was (SHA-256 of each file before and after)."""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from qkmap_hf.cli import main

from .eval_utils import build_tokenizer
from .utils import tiny_config_kwargs


def tree_digest(*roots: Path) -> dict[str, str]:
    """``path -> sha256`` of every file under ``roots`` (symlinks as their target), to compare before/after."""
    digest = {}
    for root in roots:
        for current, dirs, files in os.walk(root):
            dirs.sort()
            for name in sorted(files) + [d for d in dirs if Path(current, d).is_symlink()]:
                path = Path(current, name)
                if path.is_symlink():
                    digest[str(path)] = f"link:{os.readlink(path)}"
                elif not stat.S_ISREG(path.stat().st_mode):  # a FIFO or a device: reading it would block or never end
                    digest[str(path)] = f"special:{stat.S_IFMT(path.stat().st_mode)}"
                else:
                    digest[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
    return digest


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    """``qkmap ARGV`` through ``qkmap_hf.cli.main`` in this process: (exit code, stdout, stderr)."""
    capsys.readouterr()
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def assert_refused(code: int, err: str, *fragments: str) -> str:
    """Exit code 2, every fragment named in the error line, no traceback; returns the error line."""
    assert code == 2, err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if ": error: " in line]
    assert len(lines) == 1, err
    for fragment in fragments:
        assert fragment in lines[0], f"{fragment!r} not in: {lines[0]}"
    return lines[0]


def tiny_llama(folder: Path) -> Path:
    """A tiny Llama checkpoint (random weights) with a real byte-level BPE tokenizer, as `qkmap convert` sees one."""
    tokenizer = build_tokenizer(folder)
    torch.manual_seed(0)
    config = LlamaConfig(
        **tiny_config_kwargs(
            vocab_size=len(tokenizer),
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def tiny_gguf(folder: Path, name: str = "tiny.gguf", seed: int = 0) -> Path:
    """A tiny float32 Llama GGUF (2 layers, width 32) with a byte-level "gpt2" tokenizer of 257 tokens (id = byte,
    256 = ``<|endoftext|>``), written with the ``gguf`` package as llama.cpp lays it out; returns the folder."""
    import gguf
    import numpy as np
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    folder.mkdir(parents=True, exist_ok=True)
    spelling = bytes_to_unicode()
    tokens = [spelling[byte] for byte in range(256)] + ["<|endoftext|>"]
    vocab, hidden, inter, layers, heads, kv_heads = len(tokens), 32, 64, 2, 4, 2
    writer = gguf.GGUFWriter(str(folder / name), "llama")
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 256 + [3])  # 3: control
    writer.add_token_scores([0.0] * vocab)
    writer.add_bos_token_id(256)
    writer.add_eos_token_id(256)
    rng = np.random.default_rng(seed)

    def weight(*shape: int):
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    ones = np.ones(hidden, np.float32)
    kv = hidden // heads * kv_heads
    writer.add_tensor("token_embd.weight", weight(vocab, hidden))
    writer.add_tensor("output_norm.weight", ones)
    writer.add_tensor("output.weight", weight(vocab, hidden))
    for i in range(layers):
        for part, shape in (("attn_q", (hidden, hidden)), ("attn_k", (kv, hidden)), ("attn_v", (kv, hidden)),
                            ("attn_output", (hidden, hidden)), ("ffn_gate", (inter, hidden)),
                            ("ffn_up", (inter, hidden)), ("ffn_down", (hidden, inter))):  # fmt: skip
            writer.add_tensor(f"blk.{i}.{part}.weight", weight(*shape))
        writer.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return folder


@pytest.fixture(scope="module")
def pristine_llama(tmp_path_factory) -> Path:
    """A tiny Llama folder made once per module; tests get a copy (``src``) they may damage."""
    return tiny_llama(tmp_path_factory.mktemp("hostile") / "llama")


@pytest.fixture
def src(pristine_llama: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(pristine_llama, tmp_path / "models" / "llama"))
