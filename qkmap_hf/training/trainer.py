"""``qkmap train``: pretrain a size preset or up-train a checkpoint with transformers' Trainer.

One function, ``train(options)``, serves ``qkmap train``, ``torchrun -m qkmap_hf train`` or
``accelerate launch`` (the Trainer reads the launcher's environment and runs DDP; ``--fsdp`` shards by decoder
layer) and ``qkmap compare`` (which passes pre-built datasets so every run sees the same tokens).

The output folder is a checkpoint ready for ``qkmap push``: weights, config, the modeling files (so it loads
with ``trust_remote_code=True`` without this package), the tokenizer, and ``qkmap_training.json`` with what
produced it. With ``--lora`` the merged model goes there and the adapter into ``OUT/adapter``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from transformers import default_data_collator

from ..fileio import atomic_write_json, staged_folder
from ..filenames import SAFETENSORS_INDEX_NAME
from ..kernels import load_fused_kernel
from ..monitoring import DivergenceGuard, TrainingMonitor, plot_monitor, probe_batch
from ..provenance import PROVENANCE_FILES, TrainingRecord
from ..safety import folder_writer, load_checked_config, named_config_errors, tokenizer_file
from .data import DataStats, PackedDataset, build_datasets, byte_level_tokenizer
from .guards import (
    CheckpointCompletion,
    check_output_dir,
    check_train_options,
    pick_resume_checkpoint,
    save_failed,
    state_bytes,
)
from .optim import QKMapTrainer, classify_parameters
from .options import TrainOptions, TrainResult, parse_overrides, shared_training_arguments
from .presets import PRESETS, get_preset, preset_config

logger = logging.getLogger(__name__)

PROVENANCE_FILE = PROVENANCE_FILES["training"]
ADAPTER_SUBDIR = "adapter"
MONITOR_PLOT = "monitor.png"
DEFAULT_CHECKPOINT_LR = 1e-4
DEFAULT_CHECKPOINT_BATCH = 8
DEFAULT_CHECKPOINT_BLOCK = 1024


def is_preset(model: str) -> bool:
    """A preset name that is not also an existing folder."""
    return model in PRESETS and not Path(model).exists()


def load_tokenizer(options: TrainOptions):
    """``--tokenizer``, else the checkpoint's tokenizer, else (presets) the byte-level tokenizer."""
    from transformers import AutoTokenizer

    source = options.tokenizer or (None if is_preset(options.model) else options.model)
    if source is None:
        return byte_level_tokenizer()
    try:
        return AutoTokenizer.from_pretrained(source, trust_remote_code=options.trust_remote_code)
    except (OSError, ValueError) as error:
        raise ValueError(f"no tokenizer could be loaded from {source}; pass --tokenizer DIR. ({error})") from error


def build_model(options: TrainOptions, tokenizer, block_size: int):
    """A fresh preset model (seeded) or the checkpoint in ``options.model``, in float32."""
    from transformers import AutoModelForCausalLM, set_seed

    set_seed(options.seed)
    if is_preset(options.model):
        with named_config_errors(f"--config {', '.join(options.config)}" if options.config else "the preset config"):
            config = preset_config(
                options.model,
                options.qk_mode,
                vocab_size=len(tokenizer),
                max_position_embeddings=max(block_size, get_preset(options.model).block_size),
                bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
                **options.config,
            )
        return AutoModelForCausalLM.from_config(
            config, attn_implementation=options.attn_implementation, dtype=torch.float32
        )
    path = Path(options.model)
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"--model {options.model} is neither a size preset ({', '.join(PRESETS)}) nor a checkpoint folder with "
            "config.json."
        )
    config = load_checked_config(path, options.config, trust_remote_code=options.trust_remote_code)
    return AutoModelForCausalLM.from_pretrained(
        path,
        config=config,
        dtype=torch.float32,
        attn_implementation=options.attn_implementation,
        trust_remote_code=options.trust_remote_code,
    )


def check_tokenizer_fits(options: TrainOptions, tokenizer, model_config) -> None:
    """Every token id must have an embedding row: a tokenizer larger than the checkpoint's vocabulary would crash
    (or, on a GPU, read out of bounds) at the first batch that uses one of its extra tokens."""
    width = getattr(model_config, "vocab_size", None)
    if not width:
        return
    largest = max(tokenizer.get_vocab().values(), default=-1)
    if largest >= width:
        source = tokenizer_file(options.tokenizer or options.model)
        raise ValueError(
            f"{source} has token ids up to {largest}, but {Path(options.model) / 'config.json'} has vocab_size "
            f"{width} (embedding rows); pass the checkpoint's own tokenizer (--tokenizer) or resize the model first."
        )


def check_checkpoint_fits(checkpoint: str | None, options: TrainOptions, model) -> None:
    """``--resume`` must name a checkpoint of this model's shape; the Trainer's own error is a long traceback."""
    if checkpoint is None:
        return
    from safetensors import safe_open

    expected = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    for path in sorted(Path(checkpoint).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:  # headers only
            shapes = {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}  # noqa: SIM118
        for name, shape in shapes.items():
            if name in expected and shape != expected[name]:
                described = options.model if is_preset(options.model) else Path(options.model) / "config.json"
                raise ValueError(
                    f"--resume {path} holds {name} of shape {list(shape)}, but the model of {described} has "
                    f"{list(expected[name])}; resume with the same --model and --config it was trained with."
                )


def resolve_defaults(options: TrainOptions, model_config=None) -> dict[str, Any]:
    """Block size, batch size and learning rate: flag, else the preset's, else the checkpoint defaults."""
    preset = get_preset(options.model) if is_preset(options.model) else None
    block = options.block_size if options.block_size is not None else (preset.block_size if preset else None)
    if block is None:
        limit = getattr(model_config, "max_position_embeddings", None) or DEFAULT_CHECKPOINT_BLOCK
        block = min(DEFAULT_CHECKPOINT_BLOCK, limit)
    return {
        "block_size": block,
        "batch_size": _given(options.batch_size, preset.batch_size if preset else DEFAULT_CHECKPOINT_BATCH),
        "learning_rate": _given(options.learning_rate, preset.learning_rate if preset else DEFAULT_CHECKPOINT_LR),
    }


def _given(value, default):
    """``value`` unless it was not given (``None``): 0 means 0, never "the default"."""
    return default if value is None else value


def bf16_enabled(setting: str) -> bool:
    """``auto``: only on a GPU with native bf16 (CPU autocast in bf16 is slower than float32 here)."""
    if setting == "yes":
        return True
    if setting == "no":
        return False
    return torch.cuda.is_available() and torch.cuda.is_bf16_supported()


def training_arguments(options: TrainOptions, resolved: dict[str, Any], model, has_eval: bool):
    """transformers ``TrainingArguments`` for ``options``: the shared fields as they are, plus what is derived here."""
    from dataclasses import fields

    from transformers import TrainingArguments

    on_cpu = not torch.cuda.is_available() and not (
        hasattr(torch.backends, "mps") and torch.backends.mps.is_available()
    )
    save_steps = options.save_steps
    derived = dict(
        max_steps=options.max_steps if options.max_steps and options.max_steps > 0 else -1,
        per_device_train_batch_size=resolved["batch_size"],
        per_device_eval_batch_size=options.eval_batch_size or resolved["batch_size"],
        learning_rate=resolved["learning_rate"],
        data_seed=options.seed,
        bf16=bf16_enabled(options.bf16),
        logging_first_step=True,
        logging_nan_inf_filter=False,  # a non-finite loss is logged as such: the divergence guard must see it
        eval_strategy="steps" if has_eval else "no",
        eval_steps=options.eval_steps if has_eval else None,
        eval_on_start=options.eval_on_start and has_eval,
        save_strategy="steps" if save_steps else "no",
        save_steps=save_steps or 500,
        use_cpu=on_cpu,
        ddp_backend="gloo" if on_cpu and int(os.environ.get("WORLD_SIZE", "1")) > 1 else None,
        fsdp=True if options.fsdp else None,
        fsdp_config=fsdp_settings(options, model) if options.fsdp else None,
    )
    shared = shared_training_arguments(options, {f.name for f in fields(TrainingArguments)})
    return TrainingArguments(**{**shared, **derived})


def fsdp_settings(options: TrainOptions, model) -> dict[str, Any]:
    """Trainer ``fsdp_config``: wrap every decoder layer (``QKMapDecoderLayer`` for qkmap models) as one unit.

    A decoder layer is the natural unit: its attention (with the small ``qk_map`` module) and MLP run together,
    so one all-gather per layer serves the whole layer, and the embeddings/head form the root unit.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    layer_classes = list(getattr(base, "_no_split_modules", None) or [])
    settings: dict[str, Any] = {"auto_wrap_policy": "TRANSFORMER_BASED_WRAP"}
    if layer_classes:
        settings["transformer_layer_cls_to_wrap"] = layer_classes
    if options.fsdp_config:
        settings.update(json.loads(Path(options.fsdp_config).read_text()))
    return settings


def attach_monitoring(trainer, options: TrainOptions, probe_dataset) -> DivergenceGuard | None:
    """The attention monitor (``--monitor-steps``, on by default) and, when asked, the divergence guard."""
    probe_ids = probe_batch(probe_dataset)
    if options.monitor_steps > 0 and probe_ids is not None:
        if trainer.is_fsdp_enabled:  # a probe on rank 0 alone cannot gather sharded weights
            logger.warning("--monitor-steps: the attention monitor does not run under FSDP; use DDP to monitor.")
        else:
            TrainingMonitor.attach(trainer, probe_ids, options.monitor_steps)
    if not options.stop_on_divergence:
        return None
    guard = DivergenceGuard()
    trainer.add_callback(guard)
    return guard


def resume_checkpoint(options: TrainOptions) -> str | None:
    """The checkpoint folder ``--resume`` names (``latest``: the newest complete ``checkpoint-*``; see guards)."""
    return pick_resume_checkpoint(options.resume, options.output_dir)


# --------------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------------


def _versions() -> dict[str, str]:
    import transformers

    from ..version import __version__

    versions = {"qkmap_hf": __version__, "torch": torch.__version__, "transformers": transformers.__version__}
    for name in ("peft", "accelerate", "datasets"):
        with contextlib.suppress(ImportError):
            versions[name] = __import__(name).__version__
    return versions


def _final_save(trainer, model, tokenizer, options: TrainOptions, output_dir: Path) -> None:
    """Full checkpoint into ``output_dir`` (LoRA: adapter into ``adapter/``, merged model beside it)."""
    if options.lora:
        if trainer.is_world_process_zero():
            model.save_pretrained(output_dir / ADAPTER_SUBDIR)
            tokenizer.save_pretrained(output_dir / ADAPTER_SUBDIR)
            merged = model.merge_and_unload()
            merged.config.use_cache = True
            merged.save_pretrained(output_dir)
            tokenizer.save_pretrained(output_dir)
        return
    model.config.use_cache = True  # the Trainer turns the cache off for training; generation wants it
    trainer.save_model(str(output_dir))  # handles FSDP gathering and saves on the main process only
    if trainer.is_world_process_zero():
        # Trainer pickles its arguments beside the weights; the settings live in qkmap_training.json instead, so
        # the folder holds no pickle and passes `qkmap push` (checkpoint-*/ keep theirs for --resume).
        (output_dir / "training_args.bin").unlink(missing_ok=True)


# What a model folder holds beside its weights that describes that model: replaced with it (``replaced_by``).
MODEL_RECORDS = (*PROVENANCE_FILES.values(), "README.md", "heal.json", "heal.csv", "verification.json", "analysis")


def replaced_by(out: Path, command: str):
    """Which entries of ``out`` a final save removes: the weights it does not rewrite (an old model's other shards),
    and, when another command's model is being replaced (``--overwrite``), that model's records and card."""
    writer = folder_writer(out)
    foreign = writer is not None and writer[0] != command

    def drop(entry: Path) -> bool:
        if entry.name.endswith((".safetensors", SAFETENSORS_INDEX_NAME.removeprefix("model"))):
            return True
        return foreign and entry.name in MODEL_RECORDS

    return drop


def parallel_summary(trainer) -> dict[str, Any]:
    """How the run was distributed: world size, Trainer parallel mode, and the module classes FSDP wrapped."""
    wrapped = set()
    try:
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    except ImportError:  # pragma: no cover - torch without FSDP
        FSDPModule = FullyShardedDataParallel = ()  # noqa: N806
    root = getattr(trainer, "model_wrapped", None) or trainer.model
    for module in root.modules():
        if isinstance(module, FullyShardedDataParallel):
            wrapped.add(type(module.module).__name__)
        elif FSDPModule and isinstance(module, FSDPModule):
            wrapped.add(
                next(c.__name__ for c in type(module).__mro__ if c is not FSDPModule and "FSDP" not in c.__name__)
            )
    return {
        "world_size": trainer.args.world_size,
        "parallel_mode": str(trainer.args.parallel_mode.value),
        "fsdp_wrapped_classes": sorted(wrapped),
    }


def _activation_checkpointing(model) -> bool:
    """Whether the model recomputes activations (transformers renamed gradient -> activation checkpointing)."""
    if hasattr(model, "is_activation_checkpointing"):
        return bool(model.is_activation_checkpointing)
    return bool(getattr(model, "is_gradient_checkpointing", False))


def _write_provenance(
    path: Path,
    options: TrainOptions,
    resolved: dict,
    data: DataStats,
    model,
    result: TrainResult,
    parallel: dict,
    resumed_from: str | None,
) -> None:
    config = getattr(model, "config", None)
    grouped = classify_parameters(model, qk_norm_in_qk_group=options.qk_norm_in_qk_group)
    groups = {name: sum(p.numel() for _, p in members) for name, members in grouped.items()}
    record = TrainingRecord(
        command="qkmap train",
        options=asdict(options),
        resolved=resolved,
        resumed_from=resumed_from,
        world_size=parallel["world_size"],
        parallel=parallel,
        model={
            "model_type": getattr(config, "model_type", None),
            "qk_mode": getattr(config, "qk_mode", None),
            "parameters": sum(p.numel() for p in model.parameters()),
            "trainable_parameters_by_group": groups,
            "activation_checkpointing": _activation_checkpointing(model),
        },
        data=data.to_dict(),
        train_metrics=result.train_metrics,
        eval_metrics=result.eval_metrics,
        log_history=result.log_history,
        wall_seconds=result.wall_seconds,
        versions=_versions(),
    )
    atomic_write_json(path, record.to_dict())


def train(
    options: TrainOptions,
    *,
    datasets: tuple[PackedDataset, PackedDataset | None, DataStats] | None = None,
    tokenizer=None,
    callbacks: list | None = None,
    save: bool = True,
    trainer_class: type[QKMapTrainer] = QKMapTrainer,
    trainer_kwargs: dict[str, Any] | None = None,
    command: str = "qkmap train",
    finalize: Callable[[Path], None] | None = None,
) -> TrainResult:
    """Train as ``options`` say; ``datasets``/``tokenizer`` skip reading data again (``qkmap compare``).

    ``trainer_class``/``trainer_kwargs``: a ``QKMapTrainer`` subclass and its extra arguments (``qkmap heal``).

    ``save=False`` writes nothing but the provenance file (the comparison keeps only its numbers).

    The final save is atomic (``fileio.staged_folder``): OUT holds the complete new model or the old one, never a
    mix; a failure (a full disk) is one line naming OUT and the space needed. ``command`` is what writes OUT: the
    records and card of another command's model there (``--overwrite``) are removed with that model.
    ``finalize(folder)`` adds the caller's own files to the save before it is moved in (``qkmap heal``: records, card).
    """
    started = time.time()
    check_train_options(options)
    check_output_dir(options.model, options.output_dir, is_checkpoint=not is_preset(options.model))
    if options.lora and options.fsdp:
        raise ValueError(
            "--lora with --fsdp is not supported by qkmap train (merging needs the full weights); use DDP."
        )
    model_config = None  # read (and validated: one line naming the field) before the tokenizer reads it too
    if not is_preset(options.model) and Path(options.model, "config.json").exists():
        model_config = load_checked_config(options.model, options.config, trust_remote_code=options.trust_remote_code)
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(options)
    check_tokenizer_fits(options, tokenizer, model_config)
    resolved = resolve_defaults(options, model_config)
    if datasets is None:
        datasets = build_datasets(options.data, tokenizer, resolved["block_size"], options)
    train_dataset, eval_dataset, data_stats = datasets
    has_eval = eval_dataset is not None and len(eval_dataset) > 0

    if not torch.cuda.is_available():  # a CPU run trains with the fused feature map, built once per machine
        load_fused_kernel(build=True)
    model = build_model(options, tokenizer, resolved["block_size"])
    if options.lora:
        from .peft_support import apply_lora

        model = apply_lora(
            model,
            r=options.lora_r,
            lora_alpha=options.lora_alpha,
            lora_dropout=options.lora_dropout,
            target_modules=options.lora_target_modules,
            train_qk_parameters=options.lora_train_qk,
        )
    qkmap_lr = _given(options.qkmap_learning_rate, options.qkmap_lr_multiplier * resolved["learning_rate"])
    resolved["qkmap_learning_rate"] = qkmap_lr

    resumed_from = resume_checkpoint(options)
    check_checkpoint_fits(resumed_from, options, model)
    args = training_arguments(options, resolved, model, has_eval)
    trainer = trainer_class(
        model=model,
        args=args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset if has_eval else None,
        processing_class=tokenizer,
        data_collator=default_data_collator,  # packed blocks of equal length: no padding, no pad token needed
        callbacks=[*(callbacks or []), CheckpointCompletion()],
        qkmap_learning_rate=qkmap_lr,
        qkmap_weight_decay=options.qkmap_weight_decay,
        **(trainer_kwargs or {}),
        qk_norm_in_qk_group=options.qk_norm_in_qk_group,
    )
    if options.fsdp and not trainer.is_fsdp_enabled:
        logger.warning(
            "--fsdp: accelerate enables FSDP only on accelerators (CUDA/XPU/NPU...); this run (%s, world size %d) "
            "uses %s instead. The decoder-layer wrapping is tested on CPU with torch's fully_shard directly "
            "(tests/plugin/test_distributed.py).",
            trainer.args.device,
            trainer.args.world_size,
            trainer.args.parallel_mode.value,
        )
    guard = attach_monitoring(trainer, options, eval_dataset if has_eval else train_dataset)
    train_output = trainer.train(resume_from_checkpoint=resumed_from)
    eval_metrics: dict = {}
    if has_eval:
        last_eval = [h for h in trainer.state.log_history if "eval_loss" in h]
        if last_eval and last_eval[-1]["step"] == trainer.state.global_step:
            eval_metrics = {k: v for k, v in last_eval[-1].items() if k.startswith("eval_") or k == "step"}
        else:
            eval_metrics = trainer.evaluate()
    result = TrainResult(
        output_dir=options.output_dir,
        log_history=list(trainer.state.log_history),
        train_metrics=dict(train_output.metrics),
        eval_metrics=dict(eval_metrics),
        data=data_stats.to_dict(),
        wall_seconds=time.time() - started,
        diverged=guard.diverged if guard is not None else None,
    )
    out = Path(options.output_dir)

    def write_provenance(folder: Path) -> None:
        """The run's record and its monitor plot, beside the weights."""
        folder.mkdir(parents=True, exist_ok=True)
        record = (options, resolved, data_stats, model, result, parallel_summary(trainer), resumed_from)
        _write_provenance(folder / PROVENANCE_FILE, *record)
        plot_monitor(result.log_history, folder / MONITOR_PLOT, title=f"monitor: {options.model}")

    if save and trainer.is_world_process_zero():
        staged: list[Path] = []
        try:  # weights, tokenizer and record into a hidden folder; moved into OUT only once complete
            with staged_folder(out, drop=replaced_by(out, command)) as staging:
                staged.append(staging)
                _final_save(trainer, model, tokenizer, options, staging)
                write_provenance(staging)
                if finalize is not None:
                    finalize(staging)
        except (OSError, SafetensorError) as error:
            raise save_failed(out, error, state_bytes(model), "model", staged[0] if staged else None) from error
    elif save:  # other ranks take part in gathering the weights (FSDP); rank 0 writes
        _final_save(trainer, model, tokenizer, options, out)
    if trainer.is_world_process_zero():
        if not save:
            write_provenance(out)
        if has_eval:
            loss = eval_metrics.get("eval_loss")
            logger.info("held-out loss %.4f, perplexity %.3f", loss, math.exp(min(loss, 50.0)))
    return result


__all__ = ["TrainOptions", "TrainResult", "parse_overrides", "train"]
