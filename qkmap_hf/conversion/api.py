"""The conversion API: a model in memory (``convert_model``) or a checkpoint on disk (``convert_to_folder``).

Both resolve the adapter, build the QK-MAP config, plan every tensor (``plan.py``) and materialize it the
same way. Memory: a safetensors source stays near its largest shard (tensors that go out unchanged are
copied file to file); a GGUF source is loaded whole and dequantized by transformers first. Nothing here
writes a model card, provenance or a verification report: that is the packaging step (``qkmap_hf.packaging``,
a layer above this package), which runs inside the same atomic folder through ``finish``.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..fileio import atomic_directory
from ..loading import ResolvedSource, load_gguf_causal_lm, refuse_pickle_only, resolve_source
from ..modeling.configuration_qkmap import QKMapConfig
from ..safety import check_destination
from .adapters import ArchitectureAdapter, adapter_for
from .errors import ConversionError
from .options import (
    ConversionOptions,
    build_qkmap_config,
    check_source_config,
    conversion_options,
    normalized_source_config,
    read_source_config,
    source_architecture,
)
from .plan import ConversionPlan, plan_conversion
from .sources import DEFAULT_MAX_SHARD_BYTES, SafetensorsSource, StateDictSource, TensorSource
from .writer import copy_remote_code, copy_side_files, write_tensors


@dataclasses.dataclass
class ConversionResult:
    """What a disk conversion read and wrote; the packaging step builds provenance and the card from it."""

    resolved: ResolvedSource
    architecture: str
    source_config: dict[str, Any]
    config: QKMapConfig
    options: ConversionOptions
    dst: Path
    source_model: torch.nn.Module | None = None  # the loaded source when it had to be loaded whole (GGUF)
    tokenizer: Any = None


def prepare(config_dict: dict[str, Any], architecture: str | None, options: ConversionOptions, where: str):
    """The adapter (after its refusals) and the QK-MAP config for one source."""
    adapter: ArchitectureAdapter = adapter_for(architecture, where)
    adapter.check_config(config_dict, where)
    return adapter, build_qkmap_config(config_dict, adapter, options, where)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def convert_model(
    model: torch.nn.Module,
    options: ConversionOptions | None = None,
    *,
    init: str | None = None,
    num_frequencies: int | None = None,
    omega0: float | None = None,
    dtype: torch.dtype | str | None = None,
    share_weights: bool = False,
):
    """Return a ``QKMapForCausalLM`` computing ``model``'s function (``init="exact"``) or its native start (``init="native"``).

    Uses the same adapter and tensor plan as ``convert_checkpoint``. Weights are copied unless
    ``share_weights=True`` (then the converted model shares storage with ``model`` where dtypes agree). The
    conversion settings are ``options``' (``ConversionOptions``' defaults), the keywords given replacing its fields.
    """
    from transformers.initialization import no_init_weights

    from ..modeling.modeling_qkmap import QKMapForCausalLM

    options = conversion_options(options, init=init, num_frequencies=num_frequencies, omega0=omega0, dtype=dtype)
    architecture = type(model).__name__
    where = f"model {architecture}"
    config_dict = model.config.to_dict()
    check_source_config(config_dict, where)
    adapter, config = prepare(config_dict, architecture, options, where)
    source = StateDictSource(model.state_dict(), where, max_shard_bytes=sys.maxsize)
    plan = plan_conversion(source, adapter, config, options.dtype)
    config.dtype = _dtype_name(plan.dtype)
    state: dict[str, torch.Tensor] = {}
    for shard, planned in plan.shards:
        with source.open(shard) as read:
            for p in planned:
                tensor = plan.materialize(p, read)
                state[p.name] = tensor if share_weights or not p.sources else tensor.clone()
    with no_init_weights():
        converted = QKMapForCausalLM(config)
    result = converted.load_state_dict(state, strict=False, assign=True)
    unexpected = list(result.unexpected_keys)
    missing = [k for k in result.missing_keys if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise ConversionError(f"{where}: state dict mismatch (missing {missing[:4]}, unexpected {unexpected[:4]}).")
    if config.tie_word_embeddings:
        converted.tie_weights()
    parameter = next(model.parameters(), None)
    if parameter is not None:
        converted.to(parameter.device)  # created tensors and buffers join the source's device
    if getattr(model, "generation_config", None) is not None:
        converted.generation_config = copy.deepcopy(model.generation_config)
    return converted.eval() if not model.training else converted


def _open_source(resolved: ResolvedSource, options: ConversionOptions, max_shard_bytes: int):
    """(source, architecture, config dict, where, options, loaded model, tokenizer) for a resolved source."""
    if resolved.gguf_file is not None:
        where = str(resolved.directory / resolved.gguf_file)
        try:
            model, tokenizer = load_gguf_causal_lm(resolved.directory, resolved.gguf_file)
        except Exception as error:
            if isinstance(error, KeyboardInterrupt):
                raise
            raise ConversionError(f"{where}: transformers could not load this GGUF file ({error}).") from error
        config_dict = model.config.to_dict()
        check_source_config(config_dict, where)
        source: TensorSource = StateDictSource(model.state_dict(), where, max_shard_bytes)
        options = dataclasses.replace(options, dtype=options.dtype or torch.float32)
        return source, type(model).__name__, config_dict, where, options, model, tokenizer
    where = str(resolved.directory / "config.json")
    if not any(resolved.directory.glob("*.safetensors")):
        refuse_pickle_only(resolved.directory)  # the real problem, before any config complaint
    raw_config = read_source_config(resolved.directory)
    architecture = source_architecture(raw_config)
    adapter_for(architecture, where)  # refuse unsupported families before anything else
    config_dict = normalized_source_config(raw_config, where)
    return SafetensorsSource(resolved.directory), architecture, config_dict, where, options, None, None


def convert_to_folder(
    src: str | os.PathLike | ResolvedSource,
    dst: str | os.PathLike,
    options: ConversionOptions | None = None,
    *,
    init: str | None = None,
    num_frequencies: int | None = None,
    omega0: float | None = None,
    dtype: torch.dtype | str | None = None,
    gguf_file: str | None = None,
    overwrite: bool = False,
    progress: bool = True,
    cache_dir: str | os.PathLike | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    finish: Callable[[Path, ConversionResult], None] | None = None,
) -> ConversionResult:
    """Convert a checkpoint on disk into ``dst``: weights, config, model code, tokenizer and generation config.

    ``dst`` appears only when complete (atomic folder). ``finish(folder, result)`` runs inside the hidden
    folder just before it becomes ``dst``; what it writes appears atomically with the weights. The conversion
    settings are as in ``convert_model``.
    """
    options = conversion_options(options, init=init, num_frequencies=num_frequencies, omega0=omega0, dtype=dtype)
    dst = Path(dst).expanduser().absolute()
    resolved = src if isinstance(src, ResolvedSource) else resolve_source(src, gguf_file, cache_dir)
    check_destination([resolved.directory], dst, overwrite)
    source, architecture, config_dict, where, options, model, tokenizer = _open_source(
        resolved, options, max_shard_bytes
    )
    adapter, config = prepare(config_dict, architecture, options, where)
    plan: ConversionPlan = plan_conversion(source, adapter, config, options.dtype)
    config.dtype = _dtype_name(plan.dtype)
    result = ConversionResult(resolved, architecture, config_dict, config, options, dst, model, tokenizer)
    with atomic_directory(dst, overwrite) as tmp:
        write_tensors(plan, source, tmp, progress=progress)
        config.to_json_file(tmp / "config.json")
        copy_remote_code(tmp)
        if model is not None:
            tokenizer.save_pretrained(tmp)
            if model.generation_config is not None:
                model.generation_config.save_pretrained(tmp)
        else:
            copy_side_files(resolved.directory, tmp)
        if finish is not None:
            finish(tmp, result)
    return result


__all__ = ["ConversionResult", "convert_model", "convert_to_folder", "prepare"]
