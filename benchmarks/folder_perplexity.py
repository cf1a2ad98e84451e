"""Perplexity of several checkpoint folders on the same blocks, and each one's KL to the first (the source).

Used by ``benchmarks/qwen3_qknorm.sh`` and ``benchmarks/qwen3_heal.sh``: 128-token blocks of the training run's
held-out split (same files, seed and split as the run) and of a text never trained on.

    python benchmarks/folder_perplexity.py OUT/result.json --unseen comus.txt --models source=OUT/qwen3 \
        converted=OUT/qwen3-qkmap --data FILE [FILE ...]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import qkmap_hf  # noqa: F401 - registers the qkmap model type
from qkmap_hf.fileio import atomic_write_json
from qkmap_hf.training.data import build_datasets, pack_blocks

BLOCK_SIZE = 128
MAX_BLOCKS = 128


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", help="JSON file to write")
    parser.add_argument("--models", nargs="+", required=True, help="NAME=FOLDER; the first is the KL reference")
    parser.add_argument("--data", nargs="+", required=True, help="the training files (their held-out split is used)")
    parser.add_argument("--unseen", required=True, help="a text file never trained on")
    parser.add_argument("--unseen-name", help="its split name in the JSON (default: the file stem)")
    args = parser.parse_args(argv)

    folders = dict(item.split("=", 1) for item in args.models)
    tokenizer = AutoTokenizer.from_pretrained(next(iter(folders.values())))
    _, held_out, _ = build_datasets(args.data, tokenizer, BLOCK_SIZE, max_eval_blocks=MAX_BLOCKS, split_seed=0)
    unseen_ids = tokenizer(Path(args.unseen).read_text(encoding="utf-8"), return_tensors="pt").input_ids[0]
    splits = {
        "shakespeare_held_out": held_out.blocks,
        args.unseen_name or Path(args.unseen).stem: pack_blocks(unseen_ids, BLOCK_SIZE)[:MAX_BLOCKS],
    }
    models = {
        name: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval() for name, path in folders.items()
    }
    reference = next(iter(models))
    results = {
        "block_size": BLOCK_SIZE,
        "classes": {name: type(model).__name__ for name, model in models.items()},
        "qkmap_input_norm": {name: getattr(model.config, "qkmap_input_norm", None) for name, model in models.items()},
        "splits": {},
    }
    for split, blocks in splits.items():
        with torch.no_grad():
            logp = {name: [m(b[None]).logits[0].double().log_softmax(-1) for b in blocks] for name, m in models.items()}
        row = {"blocks": len(blocks), "tokens": int(blocks.numel())}
        for name in models:
            losses = [-lp[:-1].gather(-1, b[1:, None]).mean().item() for lp, b in zip(logp[name], blocks, strict=True)]
            row[f"{name}_loss"] = sum(losses) / len(losses)
            row[f"{name}_perplexity"] = math.exp(row[f"{name}_loss"])
            kls = [(p.exp() * (p - q)).sum(-1).mean().item() for p, q in zip(logp[reference], logp[name], strict=True)]
            row[f"{name}_kl_to_{reference}"] = sum(kls) / len(kls)
        results["splits"][split] = row
    atomic_write_json(args.output, results)
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
