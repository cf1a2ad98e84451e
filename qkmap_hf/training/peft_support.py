"""peft integration: ``model_type="qkmap"`` gets Llama's default target modules, and QK-MAP parameters can be
trained next to an adapter.

Importing this module registers the defaults (idempotent), so ``LoraConfig(task_type="CAUSAL_LM")`` without
``target_modules`` works on QK-MAP models exactly as on Llama. peft keeps one defaults dict per method in
``peft.utils.constants`` (``TRANSFORMERS_MODELS_TO_<METHOD>_TARGET_MODULES_MAPPING``) and every tuner looks its
model type up there; the dicts are shared objects, so adding a key is all a registration needs. QK-MAP models
have Llama's module names (``q_proj``... ``down_proj``), so every method gets Llama's entry.

The frequencies and gains live in one small module per layer (``self_attn.qk_map``); every query/key construction
names the modules it owns (``qkmap_hf.modeling.qk_registry.owned_modules``). Listing them in
``modules_to_save`` makes peft train a copy next to the adapter, save it in ``adapter_model.safetensors``, load
it with the adapter and swap it in on ``merge_and_unload``: the adapter alone carries the up-trained QK-MAP state.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from ..modeling.qk_registry import owned_modules

MODEL_TYPE = "qkmap"
SOURCE_MODEL_TYPE = "llama"


def register_peft_defaults() -> list[str]:
    """Give ``qkmap`` Llama's entry in every peft defaults mapping that has one; return the mapping names."""
    from peft.utils import constants

    registered = []
    for name in dir(constants):
        mapping = getattr(constants, name)
        if name.startswith("TRANSFORMERS_MODELS_TO_") and isinstance(mapping, dict) and SOURCE_MODEL_TYPE in mapping:
            if MODEL_TYPE not in mapping:
                value = mapping[SOURCE_MODEL_TYPE]
                mapping[MODEL_TYPE] = list(value) if isinstance(value, (list, tuple)) else value
            registered.append(name)
    return registered


def qk_modules_to_save(model: nn.Module) -> list[str]:
    """Names for ``modules_to_save`` that train the model's query/key parameters: the modules its query/key
    constructions own (none for standard attention)."""
    config = getattr(model, "config", None)
    names = owned_modules(config) if config is not None else ()
    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    return [name for name in names if name in present]


def qkmap_lora_config(
    model: nn.Module | None = None,
    *,
    r: int = 16,
    lora_alpha: int = 32,
    lora_dropout: float = 0.0,
    target_modules: Iterable[str] | str | None = None,
    train_qk_parameters: bool = True,
    **kwargs,
):
    """A causal-LM ``LoraConfig``; with ``train_qk_parameters`` and a model, its ``qk_map`` (or QK-Norm) modules
    go into ``modules_to_save``. ``target_modules=None`` uses the registered defaults (Llama's: q_proj, v_proj).
    """
    from peft import LoraConfig

    modules_to_save = list(kwargs.pop("modules_to_save", None) or [])
    if train_qk_parameters and model is not None:
        modules_to_save += [m for m in qk_modules_to_save(model) if m not in modules_to_save]
    if target_modules is not None and not isinstance(target_modules, str):
        target_modules = list(target_modules)  # a str is peft's regex/"all-linear" form and stays as it is
    return LoraConfig(
        task_type="CAUSAL_LM",
        r=r,
        lora_alpha=lora_alpha,
        lora_dropout=lora_dropout,
        target_modules=target_modules,
        modules_to_save=modules_to_save or None,
        **kwargs,
    )


def apply_lora(model: nn.Module, lora_config=None, **config_kwargs):
    """Wrap ``model`` with LoRA (``qkmap_lora_config(model, **config_kwargs)`` unless a config is given)."""
    from peft import get_peft_model

    return get_peft_model(model, lora_config or qkmap_lora_config(model, **config_kwargs))


register_peft_defaults()

__all__ = ["apply_lora", "qk_modules_to_save", "qkmap_lora_config", "register_peft_defaults"]
