"""Tiny, briefly trained checkpoints with a real (small) tokenizer, built offline, for the evaluation tests.

The tokenizer is a byte-level BPE trained on the task pack's Shakespeare text, so lm-eval, the analysis and the
model cards see a real ``PreTrainedTokenizerFast`` without reaching the Hub; the models are 2 layers x 64 wide
and get a few dozen AdamW steps on the same text, enough to move them off their initialisation.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from qkmap_hf import QKMapConfig, QKMapForCausalLM
from qkmap_hf.tasks import data_file

from .utils import tiny_config_kwargs

VOCAB_SIZE = 512
SPECIAL_TOKENS = ["<s>", "</s>", "<pad>"]


def training_text() -> str:
    passages = [json.loads(line)["text"] for line in data_file("shakespeare_passages.jsonl").read_text().splitlines()]
    return "\n\n".join(passages) + "\n\n" + data_file("haystack.txt").read_text()


def build_tokenizer(directory: Path):
    """Train a byte-level BPE on the bundled text and save it as a PreTrainedTokenizerFast in ``directory``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    text = training_text()
    tokenizer.train_from_iterator([text[i : i + 2000] for i in range(0, len(text), 2000)], trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    directory.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(directory)
    return fast


def save_tiny_model(
    directory: Path, tokenizer, qk_mode: str, *, seed: int = 0, train_steps: int = 30, **config_overrides
) -> Path:
    """A 2-layer QK-MAP-family model with ``qk_mode``, trained ``train_steps`` steps, saved with the tokenizer."""
    torch.manual_seed(seed)
    config = QKMapConfig(
        **tiny_config_kwargs(
            vocab_size=len(tokenizer),
            max_position_embeddings=4096,
            qk_mode=qk_mode,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            **config_overrides,
        )
    )
    model = QKMapForCausalLM(config)
    if train_steps:
        ids = torch.tensor(tokenizer(training_text()[:60000])["input_ids"])
        block, batch = 96, 8
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        generator = torch.Generator().manual_seed(seed)
        model.train()
        for _ in range(train_steps):
            starts = torch.randint(0, len(ids) - block - 1, (batch,), generator=generator)
            inputs = torch.stack([ids[s : s + block] for s in starts])
            loss = model(input_ids=inputs, labels=inputs).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        model.eval()
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


_CACHE: dict[str, dict[str, Path]] = {}
MODES = ("standard", "qk_norm", "qk_map")


def cached_models(tmp_path_factory) -> dict[str, Path]:
    """Tokenizer folder and one trained tiny model per qk_mode, built once per pytest session."""
    root = tmp_path_factory.getbasetemp() / "eval-models"
    key = str(root)
    if key not in _CACHE:
        tokenizer = build_tokenizer(root / "tokenizer")
        paths = {"tokenizer": root / "tokenizer"}
        for mode in MODES:
            paths[mode] = save_tiny_model(root / f"tiny-{mode.replace('_', '-')}", tokenizer, mode)
        _CACHE[key] = paths
    return _CACHE[key]


def run_command(name: str, argv: list[str]) -> int:
    """``qkmap NAME ARGV...`` in this process, through the real CLI entry point."""
    from qkmap_hf.cli import main

    return main([name, *argv])


def single_thread():
    """Generator for an autouse fixture: one torch thread (2 OpenMP threads crawl on a shared, busy 2-core box)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
