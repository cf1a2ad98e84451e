"""What a training run is told: ``TrainOptions`` (the library's dataclass) and the ``qkmap train`` flags for it.

``qkmap heal`` and ``qkmap compare`` reuse both; ``TrainResult`` is what ``train()`` returns.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field, fields
from typing import Any

from .optim import QKMAP_LR_MULTIPLIER
from .presets import PRESETS


@dataclass
class TrainOptions:
    """Everything ``qkmap train`` accepts; field names match the command-line flags (``--max-steps``...)."""

    model: str
    data: list[str]
    output_dir: str
    qk_mode: str = "qk_map"
    config: dict[str, Any] = field(default_factory=dict)
    tokenizer: str | None = None
    trust_remote_code: bool = False
    text_field: str = "text"
    block_size: int | None = None
    max_tokens: int | None = None
    eval_fraction: float = 0.05
    max_eval_blocks: int | None = 256
    split_seed: int = 0
    max_steps: int = -1
    num_train_epochs: float = 1.0
    batch_size: int | None = None
    eval_batch_size: int | None = None
    gradient_accumulation_steps: int = 1
    learning_rate: float | None = None
    qkmap_learning_rate: float | None = None
    qkmap_lr_multiplier: float = QKMAP_LR_MULTIPLIER
    weight_decay: float = 0.1
    qkmap_weight_decay: float = 0.0
    qk_norm_in_qk_group: bool = False  # QK-Norm's norm weights at the QK-MAP group's rate (qkmap compare)
    adam_beta2: float = 0.95
    lr_scheduler: str = "cosine"
    warmup: float = 0.05
    max_grad_norm: float = 1.0
    seed: int = 0
    bf16: str = "auto"
    gradient_checkpointing: bool = False
    logging_steps: float = 10
    eval_steps: float = 0.1
    eval_on_start: bool = True
    save_steps: float = 0.1
    save_total_limit: int | None = 2
    resume: str | None = None
    lora: bool = False
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    lora_target_modules: list[str] | None = None
    lora_train_qk: bool = True
    attn_implementation: str = "sdpa"
    fsdp: bool = False
    fsdp_config: str | None = None
    dataloader_num_workers: int = 0
    report_to: str = "none"
    disable_tqdm: bool = False

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> TrainOptions:
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in vars(args).items() if k in known}
        values["config"] = parse_overrides(getattr(args, "config", None) or [])
        return cls(**values)


@dataclass
class TrainResult:
    """What a run produced: the output folder, the Trainer's log history and the final metrics."""

    output_dir: str
    log_history: list[dict]
    train_metrics: dict
    eval_metrics: dict
    data: dict
    wall_seconds: float


# --------------------------------------------------------------------------------------------------
# Command-line flags (shared by `qkmap train` and `python -m qkmap_hf.train`)
# --------------------------------------------------------------------------------------------------


def _parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``["key=value", ...]`` -> dict; values are JSON when they parse (numbers, true, null), else strings."""
    overrides = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--config {item!r} must look like FIELD=VALUE, e.g. qkmap_min_frequency=0.1.")
        overrides[key.strip()] = _parse_value(value.strip())
    return overrides


def _float_or_int(text: str) -> float:
    value = float(text)
    return int(value) if value >= 1 and value.is_integer() else value


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``qkmap train`` (also used by ``python -m qkmap_hf.train``)."""
    d = TrainOptions("", [], "")
    g = parser.add_argument_group("model")
    g.add_argument("--model", required=True, help=f"a size preset ({', '.join(PRESETS)}) or a checkpoint folder")
    g.add_argument("--qk-mode", default=d.qk_mode, choices=("standard", "qk_norm", "qk_map"), help="presets only")
    g.add_argument("--config", action="append", metavar="FIELD=VALUE",
                   help="QKMapConfig field for a preset (or a config override for a checkpoint); repeatable")
    g.add_argument("--tokenizer", help="tokenizer folder (default: the checkpoint's; byte-level for presets)")
    g.add_argument("--trust-remote-code", action="store_true", help="allow custom code of non-qkmap checkpoints")
    g.add_argument("--attn-implementation", default=d.attn_implementation)

    g = parser.add_argument_group("data")
    g.add_argument("--data", nargs="+", required=True, metavar="PATH",
                   help="text files, folders of them, JSONL files, or datasets save_to_disk folders")
    g.add_argument("--text-field", default=d.text_field, help="JSONL field / dataset column with the text")
    g.add_argument("--block-size", type=int, help="tokens per packed block (default: the preset's, or 1024)")
    g.add_argument("--max-tokens", type=int, help="read at most this many tokens")
    g.add_argument("--eval-fraction", type=float, default=d.eval_fraction, help="held-out share of the blocks")
    g.add_argument("--max-eval-blocks", type=int, default=d.max_eval_blocks, help="cap on held-out blocks")
    g.add_argument("--split-seed", type=int, default=d.split_seed, help="seed of the held-out split")

    g = parser.add_argument_group("training")
    g.add_argument("--output-dir", required=True)
    g.add_argument("--max-steps", type=int, default=d.max_steps, help="optimizer steps (default: one epoch)")
    g.add_argument("--num-train-epochs", type=float, default=d.num_train_epochs)
    g.add_argument("--batch-size", type=int, help="per-device batch (default: the preset's, or 8)")
    g.add_argument("--eval-batch-size", type=int)
    g.add_argument("--gradient-accumulation-steps", type=int, default=d.gradient_accumulation_steps)
    g.add_argument("--learning-rate", type=float, help="base learning rate (default: the preset's, or 1e-4)")
    g.add_argument("--qkmap-learning-rate", type=float, help="learning rate of QK-MAP frequencies and gains")
    g.add_argument("--qkmap-lr-multiplier", type=float, default=d.qkmap_lr_multiplier,
                   help="QK-MAP learning rate as a multiple of the base (when --qkmap-learning-rate is not given)")
    g.add_argument("--weight-decay", type=float, default=d.weight_decay)
    g.add_argument("--qkmap-weight-decay", type=float, default=d.qkmap_weight_decay)
    g.add_argument("--adam-beta2", type=float, default=d.adam_beta2)
    g.add_argument("--lr-scheduler", default=d.lr_scheduler)
    g.add_argument("--warmup", type=_float_or_int, default=d.warmup, help="warm-up steps, or a fraction if < 1")
    g.add_argument("--max-grad-norm", type=float, default=d.max_grad_norm)
    g.add_argument("--seed", type=int, default=d.seed)
    g.add_argument("--bf16", default=d.bf16, choices=("auto", "yes", "no"), help="auto: on where the GPU supports it")
    g.add_argument("--gradient-checkpointing", action="store_true")
    g.add_argument("--logging-steps", type=_float_or_int, default=d.logging_steps)
    g.add_argument("--eval-steps", type=_float_or_int, default=d.eval_steps, help="steps, or fraction of the run")
    g.add_argument("--no-eval-on-start", dest="eval_on_start", action="store_false")
    g.add_argument("--save-steps", type=_float_or_int, default=d.save_steps, help="0 saves only at the end")
    g.add_argument("--save-total-limit", type=int, default=d.save_total_limit)
    g.add_argument("--resume", nargs="?", const="latest", metavar="CHECKPOINT",
                   help="continue from the latest checkpoint-* in --output-dir, or from the folder given")
    g.add_argument("--fsdp", action="store_true",
                   help="FSDP (version 2) instead of DDP under torchrun/accelerate, one shard unit per decoder layer")
    g.add_argument("--fsdp-config", help="JSON file with more Trainer fsdp_config keys (merged over the defaults)")
    g.add_argument("--dataloader-num-workers", type=int, default=d.dataloader_num_workers)
    g.add_argument("--report-to", default=d.report_to, help="Trainer integrations (none, tensorboard, wandb...)")
    g.add_argument("--disable-tqdm", action="store_true")

    g = parser.add_argument_group("LoRA")
    g.add_argument("--lora", action="store_true", help="train a LoRA adapter (+ the QK-MAP parameters)")
    g.add_argument("--lora-r", type=int, default=d.lora_r)
    g.add_argument("--lora-alpha", type=int, default=d.lora_alpha)
    g.add_argument("--lora-dropout", type=float, default=d.lora_dropout)
    g.add_argument("--lora-target-modules", nargs="+", help="default: peft's defaults for the model type")
    g.add_argument("--no-lora-train-qk", dest="lora_train_qk", action="store_false",
                   help="freeze QK-MAP frequencies/gains (or QK-Norm weights) under LoRA")


# --------------------------------------------------------------------------------------------------
# Building the pieces
# --------------------------------------------------------------------------------------------------
