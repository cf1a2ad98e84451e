"""Helpers of the hostile-input suite (tests/test_hostile_*.py): run the CLI in this process and prove that a
refusal left every file as it was (SHA-256 of each file before and after)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

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
