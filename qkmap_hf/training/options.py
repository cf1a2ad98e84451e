"""What a training run is told: ``TrainOptions``, declared once; the ``qkmap train`` flags and the Trainer's
``TrainingArguments`` are both built from its fields.

Each field carries its help (``metadata={"help": ...}``); ``HfArgumentParser`` makes the flags from them
(``qkmap_hf.flags`` says how, and names the few actions a field's metadata may add). The groups that ``qkmap
compare`` shares (``DataOptions`` from ``training/data.py``, ``OptimizationOptions``, ``RunOptions``) are declared
once and inherited by ``TrainOptions`` and ``CompareOptions``; ``qkmap heal`` reuses ``TrainOptions``.
``TrainResult`` is what ``train()`` returns.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Literal

from ..flags import OverridesAction, parse_overrides, parsed_by, steps_or_fraction
from ..monitoring import DEFAULT_MONITOR_STEPS
from .data import DataOptions
from .optim import QKMAP_LR_MULTIPLIER
from .presets import PRESETS

# A field whose name is also a TrainingArguments field goes there as it is; these three go under the Trainer's name.
TRAINING_ARGUMENT_NAMES = {
    "lr_scheduler": "lr_scheduler_type",
    "warmup": "warmup_steps",
    "gradient_checkpointing": "activation_checkpointing",
}


def _help(text: str, **extra: Any) -> dict[str, Any]:
    return {"help": text, **extra}


STEPS = parsed_by(steps_or_fraction)


@dataclass(kw_only=True)
class OptimizationOptions:
    """The optimizer settings every training command shares (train, heal, compare; ``qkmap train`` adds the rest)."""

    batch_size: int | None = field(default=None, metadata=_help("per-device batch (default: the preset's, or 8)"))
    learning_rate: float | None = field(
        default=None, metadata=_help("base learning rate (default: the preset's, or 1e-4)")
    )
    qkmap_lr_multiplier: float = field(
        default=QKMAP_LR_MULTIPLIER,
        metadata=_help("QK-MAP learning rate as a multiple of the base (when --qkmap-learning-rate is not given)"),
    )
    weight_decay: float = field(default=0.1, metadata=_help("AdamW weight decay of the matrices"))
    warmup: float = field(default=0.05, metadata=_help("warm-up steps, or a fraction if < 1", action=STEPS))
    qk_norm_in_qk_group: bool = field(
        default=False,
        metadata=_help(
            "QK-Norm's norm weights at the QK-MAP group's rate (qkmap compare --tune sets it: qk_lr_multiplier tunes "
            "both)"
        ),
    )


@dataclass(kw_only=True)
class RunOptions:
    """How each run's model is built and watched, shared by every training command."""

    config: dict[str, Any] = field(
        default_factory=dict,
        metadata=_help(
            "QKMapConfig field for a preset (or a config override for a checkpoint); repeatable",
            action=OverridesAction,
        ),
    )
    attn_implementation: str = field(default="sdpa", metadata=_help("attention kernel: sdpa, eager, flash_attention_2"))
    monitor_steps: int = field(
        default=DEFAULT_MONITOR_STEPS,
        metadata=_help("steps between attention-logit monitor probes (logged as monitor/...); 0 turns it off"),
    )


# The groups ``qkmap compare`` shares with ``qkmap train``; ``training/compare.py`` copies them into each run's options.
SHARED_GROUPS: tuple[type, ...] = (RunOptions, OptimizationOptions, DataOptions)


@dataclass
class TrainOptions(*SHARED_GROUPS):
    """Everything ``qkmap train`` accepts; field ``max_steps`` is flag ``--max-steps`` (see ``qkmap_hf.flags``).

    ``model``, ``data`` and ``output_dir`` may be given by position; every other field by keyword (the shared
    groups are keyword-only)."""

    model: str = field(metadata=_help(f"a size preset ({', '.join(PRESETS)}) or a checkpoint folder"))
    data: list[str] = field(
        metadata=_help("text files, folders of them, JSONL files, or datasets save_to_disk folders", metavar="PATH")
    )
    output_dir: str = field(metadata=_help("where the model, checkpoints and qkmap_training.json go"))
    qk_mode: Literal["standard", "qk_norm", "qk_map"] = field(
        default="qk_map", metadata=_help("attention of a size preset (presets only)")
    )
    trust_remote_code: bool = field(default=False, metadata=_help("allow custom code of non-qkmap checkpoints"))
    max_steps: int = field(default=-1, metadata=_help("optimizer steps (default: one epoch)"))
    num_train_epochs: float = field(default=1.0, metadata=_help("epochs when --max-steps is not given"))
    eval_batch_size: int | None = field(
        default=None, metadata=_help("per-device held-out batch (default: --batch-size)")
    )
    gradient_accumulation_steps: int = field(default=1, metadata=_help("micro-batches per optimizer step"))
    qkmap_learning_rate: float | None = field(
        default=None, metadata=_help("learning rate of QK-MAP frequencies and gains")
    )
    qkmap_weight_decay: float = field(default=0.0, metadata=_help("weight decay of QK-MAP frequencies and gains"))
    adam_beta2: float = field(default=0.95, metadata=_help("AdamW beta2"))
    lr_scheduler: str = field(default="cosine", metadata=_help("Trainer learning-rate schedule (lr_scheduler_type)"))
    max_grad_norm: float = field(default=1.0, metadata=_help("gradient clipping norm"))
    seed: int = field(default=0, metadata=_help("seed of initialisation and data order"))
    bf16: Literal["auto", "yes", "no"] = field(default="auto", metadata=_help("auto: on where the GPU supports it"))
    gradient_checkpointing: bool = field(default=False, metadata=_help("recompute activations to save memory"))
    logging_steps: float = field(
        default=10, metadata=_help("steps between loss logs, or fraction of the run", action=STEPS)
    )
    eval_steps: float = field(
        default=0.1, metadata=_help("steps between evaluations, or fraction of the run", action=STEPS)
    )
    eval_on_start: bool = field(default=True, metadata=_help("evaluate before the first step (--no-eval-on-start)"))
    save_steps: float = field(
        default=0.1, metadata=_help("steps between checkpoints, or fraction; 0 saves only at the end", action=STEPS)
    )
    save_total_limit: int | None = field(default=2, metadata=_help("checkpoints kept"))
    resume: str | None = field(
        default=None,
        metadata=_help(
            "continue from the latest checkpoint-* in --output-dir, or from the folder given",
            nargs="?",
            const="latest",
            metavar="CHECKPOINT",
        ),
    )
    lora: bool = field(default=False, metadata=_help("train a LoRA adapter (+ the QK-MAP parameters)"))
    lora_r: int = field(default=16, metadata=_help("LoRA rank"))
    lora_alpha: int = field(default=32, metadata=_help("LoRA alpha"))
    lora_dropout: float = field(default=0.0, metadata=_help("LoRA dropout"))
    lora_target_modules: list[str] | None = field(
        default=None, metadata=_help("LoRA target modules (default: peft's defaults for the model type)")
    )
    lora_train_qk: bool = field(
        default=True,
        metadata=_help("train QK-MAP frequencies/gains (or QK-Norm weights) under LoRA (--no-lora-train-qk)"),
    )
    fsdp: bool = field(
        default=False,
        metadata=_help("FSDP (version 2) instead of DDP under torchrun/accelerate, one shard unit per decoder layer"),
    )
    fsdp_config: str | None = field(
        default=None, metadata=_help("JSON file with more Trainer fsdp_config keys (merged over the defaults)")
    )
    dataloader_num_workers: int = field(default=0, metadata=_help("data-loader worker processes"))
    report_to: str = field(default="none", metadata=_help("Trainer integrations (none, tensorboard, wandb...)"))
    disable_tqdm: bool = field(default=False, metadata=_help("no progress bars"))
    stop_on_divergence: bool = field(
        default=False,
        metadata=_help("stop a run whose loss is not finite or stays above its initial loss (qkmap compare sets it)"),
    )


def shared_fields(options: Any, *groups: type) -> dict[str, Any]:
    """``options``' values of the fields of ``groups`` (default: ``SHARED_GROUPS``), to build another command's
    options from them without naming each field by hand."""
    names = [f.name for group in groups or SHARED_GROUPS for f in fields(group)]
    return {name: getattr(options, name) for name in names}


def shared_training_arguments(options: TrainOptions, trainer_fields: set[str]) -> dict[str, Any]:
    """The options that ``TrainingArguments`` takes as they are: same name, or the name in TRAINING_ARGUMENT_NAMES."""
    shared = {}
    for option in fields(options):
        name = TRAINING_ARGUMENT_NAMES.get(option.name, option.name)
        if name in trainer_fields:
            shared[name] = getattr(options, option.name)
    return shared


@dataclass
class TrainResult:
    """What a run produced: the output folder, the Trainer's log history and the final metrics."""

    output_dir: str
    log_history: list[dict]
    train_metrics: dict
    eval_metrics: dict
    data: dict
    wall_seconds: float
    diverged: dict | None = None  # DivergenceGuard's record when the run was stopped as diverged


__all__ = [
    "SHARED_GROUPS",
    "DataOptions",
    "OptimizationOptions",
    "RunOptions",
    "TrainOptions",
    "TrainResult",
    "parse_overrides",
    "shared_fields",
    "shared_training_arguments",
]
