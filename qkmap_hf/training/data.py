"""Training data: read text, tokenize with the model's tokenizer, pack into fixed-length blocks, hold out a split.

Sources (any mix, in the order given): plain-text files, folders of them (recursively, sorted, so the order is
the same on every machine), JSONL files (one document per line, text in ``text_field``) and folders written by
``datasets``' ``save_to_disk``. Every document ends with the tokenizer's EOS token; the token stream is cut into
blocks of ``block_size`` (the tail is dropped) and a seeded random subset of blocks becomes the held-out split.
Packing leaves no padding, so every position carries a label and a loss mean over a batch is a mean over tokens.
"""

from __future__ import annotations

import json
import stat
import sys
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from ..safety import read_text_file

TEXT_SUFFIXES = (".txt", ".text", ".md", ".rst")
JSONL_SUFFIXES = (".jsonl", ".ndjson")
BYTE_LEVEL_EOS = "<|endoftext|>"
_TOKENIZE_BATCH = 256


@dataclass(kw_only=True)
class DataOptions:
    """How text becomes packed blocks and a held-out split: the data group of ``qkmap train``, ``heal`` and
    ``compare`` (``TrainOptions`` and ``CompareOptions`` inherit it), and what ``build_datasets`` reads.

    Declared once, here: each field's default and help are those of its flag (``qkmap_hf.flags``). The sources
    themselves (``--data``) stay with each command, which requires them (train) or takes ``--task`` instead (compare).
    """

    tokenizer: str | None = field(
        default=None, metadata={"help": "tokenizer folder (default: the checkpoint's; byte-level for presets)"}
    )
    text_field: str = field(default="text", metadata={"help": "JSONL field / dataset column with the text"})
    block_size: int | None = field(
        default=None, metadata={"help": "tokens per packed block (default: the preset's, or 1024)"}
    )
    max_tokens: int | None = field(default=None, metadata={"help": "read at most this many tokens"})
    eval_fraction: float = field(default=0.05, metadata={"help": "held-out share of the blocks"})
    max_eval_blocks: int | None = field(default=256, metadata={"help": "cap on held-out blocks"})
    split_seed: int = field(default=0, metadata={"help": "seed of the held-out split"})


# --------------------------------------------------------------------------------------------------
# Byte-level tokenizer for models trained from scratch
# --------------------------------------------------------------------------------------------------


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table, so a BPE vocabulary can hold every byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {byte: chr(char) for byte, char in zip(printable, chars, strict=True)}


def byte_level_tokenizer():
    """A 257-token byte tokenizer (id = byte value, 256 = ``<|endoftext|>``) built offline.

    It is a ``PreTrainedTokenizerFast`` over a merge-free ByteLevel BPE, so it saves as ``tokenizer.json`` next to
    the checkpoint and loads with ``AutoTokenizer`` without this package, like any Hub tokenizer.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    table = _bytes_to_unicode()
    vocab = {table[byte]: byte for byte in range(256)}
    vocab[BYTE_LEVEL_EOS] = 256
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(BYTE_LEVEL_EOS, special=True)])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token=BYTE_LEVEL_EOS, bos_token=BYTE_LEVEL_EOS, pad_token=BYTE_LEVEL_EOS
    )


# --------------------------------------------------------------------------------------------------
# Reading documents
# --------------------------------------------------------------------------------------------------


def _is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and any((path / name).exists() for name in ("dataset_dict.json", "state.json"))


def _iter_jsonl(path: Path, text_field: str) -> Iterator[str]:
    blank = True
    with path.open(encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            blank = False
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{line_number} is not JSON ({error.msg}); fix or remove the line.") from error
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{line_number} is a JSON {type(record).__name__}, not an object with fields.")
            if text_field not in record:
                raise ValueError(
                    f"{path}:{line_number} has no field {text_field!r} (fields: {', '.join(map(str, record))}); "
                    "pass --text-field with the name of the text field."
                )
            text = record[text_field]
            if not isinstance(text, str):  # str(None) would train on the word "None"
                raise ValueError(
                    f"{path}:{line_number}: field {text_field!r} is {json.dumps(text)[:60]} (a JSON "
                    f"{type(text).__name__}), not a string; fix or remove the line."
                )
            yield text
    if blank:
        _warn_if_blank(path, "")


def _iter_saved_dataset(path: Path, text_field: str) -> Iterator[str]:
    from datasets import DatasetDict, load_from_disk

    dataset = load_from_disk(str(path))
    if isinstance(dataset, DatasetDict):
        split = "train" if "train" in dataset else next(iter(dataset))
        dataset = dataset[split]
    if text_field not in dataset.column_names:
        raise ValueError(
            f"dataset {path} has no column {text_field!r} (columns: {', '.join(dataset.column_names)}); "
            "pass --text-field with the name of the text column."
        )
    for start in range(0, len(dataset), 1000):
        yield from dataset[start : start + 1000][text_field]


def _files_under(folder: Path) -> list[Path]:
    files = [
        p
        for p in sorted(folder.rglob("*"))
        if p.is_file()
        and not any(part.startswith(".") for part in p.relative_to(folder).parts)
        and p.suffix.lower() in TEXT_SUFFIXES + JSONL_SUFFIXES
    ]
    if not files:
        raise ValueError(
            f"folder {folder} holds no text files ({', '.join(TEXT_SUFFIXES + JSONL_SUFFIXES)}) and is not a "
            "`datasets` save_to_disk folder; point --data at files or at such a folder."
        )
    return files


def check_data_paths(paths: Sequence[str | Path]) -> None:
    """Every ``--data`` path exists and is a regular file or a folder, checked before anything is read: a FIFO or
    a device would block or never end, and a later path failing after minutes of reading wastes them."""
    if not paths:
        raise ValueError("no data given; pass --data with text files, JSONL files or dataset folders.")
    for raw in paths:
        path = Path(raw).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"--data {raw}: no such file or folder.")
        mode = path.stat().st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            kind = "a FIFO (named pipe)" if stat.S_ISFIFO(mode) else "a device or socket"
            raise ValueError(f"--data {raw} is {kind}, not a regular file or a folder; pass text, JSONL or folders.")


def _warn_if_blank(file: Path, text: str) -> str:
    if not text.strip():
        print(f"warning: --data {file} holds only whitespace; it adds no text.", file=sys.stderr, flush=True)
    return text


def iter_documents(paths: Sequence[str | Path], text_field: str = "text") -> Iterator[str]:
    """Yield documents from every source in ``paths`` (see the module docstring for what counts as a source)."""
    check_data_paths(paths)
    for raw in paths:
        path = Path(raw).expanduser()
        if _is_saved_dataset(path):
            yield from _iter_saved_dataset(path, text_field)
            continue
        for file in _files_under(path) if path.is_dir() else [path]:
            if file.suffix.lower() in JSONL_SUFFIXES:
                try:
                    yield from _iter_jsonl(file, text_field)
                except UnicodeDecodeError as error:  # binary or another encoding: name the file
                    raise ValueError(f"{file} is not UTF-8 text ({error.reason}); convert it to UTF-8.") from error
            else:
                yield _warn_if_blank(
                    file, read_text_file(file)
                )  # binary or non-UTF-8 input is refused, naming the file


# --------------------------------------------------------------------------------------------------
# Tokenizing and packing
# --------------------------------------------------------------------------------------------------


def tokenize_documents(
    documents: Iterator[str] | Sequence[str], tokenizer, max_tokens: int | None = None
) -> torch.Tensor:
    """One flat int64 tensor of token ids: each document's tokens followed by EOS, cut at ``max_tokens``."""
    eos = tokenizer.eos_token_id
    chunks: list[torch.Tensor] = []
    total = 0
    batch: list[str] = []

    def flush() -> None:
        nonlocal total
        encoded = tokenizer(batch, add_special_tokens=False, return_attention_mask=False)["input_ids"]
        for ids in encoded:
            if eos is not None:
                ids = [*ids, eos]
            chunks.append(torch.tensor(ids, dtype=torch.long))
            total += len(ids)
        batch.clear()

    for document in documents:
        if not document:
            continue
        batch.append(document)
        if len(batch) >= _TOKENIZE_BATCH:
            flush()
        if max_tokens is not None and total >= max_tokens:
            break
    if batch and (max_tokens is None or total < max_tokens):
        flush()
    tokens = torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.long)
    return tokens[:max_tokens] if max_tokens is not None else tokens


def pack_blocks(tokens: torch.Tensor, block_size: int) -> torch.Tensor:
    """``(num_blocks, block_size)`` view of the stream; the incomplete tail is dropped."""
    num_blocks = tokens.numel() // block_size
    return tokens[: num_blocks * block_size].view(num_blocks, block_size)


def split_blocks(
    blocks: torch.Tensor, eval_fraction: float, max_eval_blocks: int | None, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded random held-out subset of blocks: the same seed gives the same split on every machine."""
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"--eval-fraction={eval_fraction} must be in [0, 1).")
    num_eval = round(len(blocks) * eval_fraction) if eval_fraction > 0 else 0
    if eval_fraction > 0:
        num_eval = max(num_eval, 1)
    if max_eval_blocks is not None:
        num_eval = min(num_eval, max_eval_blocks)
    if len(blocks) - num_eval < 1:
        raise ValueError(f"only {len(blocks)} blocks of data; add text, lower --block-size or lower --eval-fraction.")
    order = torch.randperm(len(blocks), generator=torch.Generator().manual_seed(seed))
    eval_index, _ = order[:num_eval].sort()
    train_index, _ = order[num_eval:].sort()
    return blocks[train_index], blocks[eval_index]


class PackedDataset(Dataset):
    """Fixed-length blocks as ``{"input_ids", "labels"}`` examples (the model shifts labels itself).

    ``labels`` (same shape, ``-100`` where no loss is wanted) defaults to the blocks themselves: language modelling.
    """

    def __init__(self, blocks: torch.Tensor, labels: torch.Tensor | None = None):
        self.blocks = blocks
        self.labels = labels

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        block = self.blocks[index]
        return {"input_ids": block, "labels": block.clone() if self.labels is None else self.labels[index]}

    def subset(self, rows: slice) -> PackedDataset:
        """The blocks (and labels) in ``rows``."""
        return PackedDataset(self.blocks[rows], None if self.labels is None else self.labels[rows])


@dataclass
class DataStats:
    """What went into a run, for ``qkmap_training.json`` and the compare report."""

    sources: list[str]
    text_field: str
    block_size: int
    tokens: int
    train_blocks: int
    eval_blocks: int
    split_seed: int
    eval_fraction: float
    max_tokens: int | None = None
    tokenizer: str = ""
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def build_datasets(
    paths: Sequence[str | Path],
    tokenizer,
    block_size: int,
    options: DataOptions | None = None,
    **settings: Any,
) -> tuple[PackedDataset, PackedDataset, DataStats]:
    """Read, tokenize, pack and split ``paths``; return train and held-out datasets plus statistics.

    The read and split settings are ``options``' (any ``DataOptions``: ``TrainOptions``, ``CompareOptions``;
    ``DataOptions()`` when not given), with ``settings`` (``eval_fraction=0.0``, ...) replacing single fields, so
    their defaults are ``DataOptions``' and nowhere else.
    """
    data = DataOptions(**{f.name: getattr(options, f.name) for f in fields(DataOptions)}) if options else DataOptions()
    data = replace(data, **settings)
    text_field, eval_fraction, max_eval_blocks = data.text_field, data.eval_fraction, data.max_eval_blocks
    split_seed, max_tokens = data.split_seed, data.max_tokens
    if block_size < 2:
        raise ValueError(f"--block-size={block_size} must be at least 2 (one input and one label).")
    tokens = tokenize_documents(iter_documents(paths, text_field), tokenizer, max_tokens)
    blocks = pack_blocks(tokens, block_size)
    if len(blocks) < 2:
        raise ValueError(
            f"--data {' '.join(map(str, paths))} gives {tokens.numel()} tokens, fewer than two blocks of "
            f"{block_size}; add text or lower --block-size."
        )
    train_blocks, eval_blocks = split_blocks(blocks, eval_fraction, max_eval_blocks, split_seed)
    stats = DataStats(
        sources=[str(p) for p in paths],
        text_field=text_field,
        block_size=block_size,
        tokens=int(tokens.numel()),
        train_blocks=len(train_blocks),
        eval_blocks=len(eval_blocks),
        split_seed=split_seed,
        eval_fraction=eval_fraction,
        max_tokens=max_tokens,
        tokenizer=getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__,
    )
    return PackedDataset(train_blocks), PackedDataset(eval_blocks), stats


__all__ = [
    "DataOptions",
    "DataStats",
    "PackedDataset",
    "build_datasets",
    "byte_level_tokenizer",
    "check_data_paths",
    "iter_documents",
    "pack_blocks",
    "split_blocks",
    "tokenize_documents",
]
