"""What the user chose (``ConversionOptions``) and the source and QK-MAP configs, validated once for every entry point."""

from __future__ import annotations

import dataclasses
import json
import math
import warnings
from pathlib import Path
from typing import Any

import torch

from ..flags import parsed_by
from ..modeling.configuration_qkmap import FLOAT32_MAX, FLOAT32_TINY, QKMapConfig
from .adapters import ArchitectureAdapter
from .errors import ConversionError

INITS = ("exact", "native")  # QKMapConfig.qkmap_init's names
# The old name of the native init, still accepted (--init canonical, init="canonical"); see ConversionOptions.
DEPRECATED_INIT_NAMES = {"canonical": "native"}
DEFAULT_OMEGA0 = 1e-3
DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_REQUIRED_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


@dataclasses.dataclass(frozen=True)
class ConversionOptions:
    """What the user chose; validated once so every entry point refuses the same bad values.

    The conversion group: ``qkmap convert``'s ``--init``, ``--num-frequencies``, ``--omega0`` and ``--dtype`` are
    these fields (``qkmap_hf.flags``), and ``convert_model``, ``convert_to_folder`` and ``convert_checkpoint`` take
    the object (``conversion_options``), so each default is written here and nowhere else.
    """

    init: str = dataclasses.field(
        default="exact",
        metadata={
            "help": "exact: function-preserving (omega_0, gains 1/omega_0); native: QKMapConfig's own init (geometric "
            "frequencies, unit gains), drifts; canonical: deprecated name of native",
            "choices": (*INITS, *DEPRECATED_INIT_NAMES),
            "metavar": "{" + ",".join(INITS) + "}",  # the deprecated name parses but is not offered
        },
    )
    num_frequencies: int = dataclasses.field(default=1, metadata={"help": "frequency blocks F", "metavar": "F"})
    omega0: float = dataclasses.field(default=DEFAULT_OMEGA0, metadata={"help": "omega_0 of the exact init"})
    dtype: torch.dtype | None = dataclasses.field(
        default=None,
        metadata={
            "help": "output weight dtype (default: source's)",
            "choices": tuple(DTYPE_NAMES),
            "action": parsed_by(str),  # the name; __post_init__ makes it a torch.dtype
        },
    )

    def __post_init__(self) -> None:
        init = DEPRECATED_INIT_NAMES.get(self.init, self.init)
        if init != self.init:
            warnings.warn(
                f"init={self.init!r} is deprecated; it is called {init!r} (QKMapConfig.qkmap_init).",
                FutureWarning,
                stacklevel=3,
            )
        object.__setattr__(self, "init", init)
        if init not in INITS:
            raise ConversionError(f"init={self.init!r} is invalid; choose one of: {', '.join(INITS)}.")
        if (
            isinstance(self.num_frequencies, bool)
            or not isinstance(self.num_frequencies, int)
            or self.num_frequencies < 1
        ):
            raise ConversionError(f"num_frequencies={self.num_frequencies!r} is invalid; it must be an integer >= 1.")
        if not (isinstance(self.omega0, (int, float)) and math.isfinite(self.omega0) and self.omega0 > 0):
            raise ConversionError(f"omega0={self.omega0!r} is invalid; it must be a positive number (default 1e-3).")
        if not FLOAT32_TINY <= self.omega0 <= FLOAT32_MAX:  # the exact init's sine gain 1/omega0 must be a float32
            raise ConversionError(
                f"omega0={self.omega0!r} (--omega0) is invalid; its magnitude must lie between {FLOAT32_TINY:.3g} and "
                f"{FLOAT32_MAX:.3g} so that the float32 gain 1/omega0 is finite (default 1e-3)."
            )
        if isinstance(self.dtype, str):
            if self.dtype not in DTYPE_NAMES:
                raise ConversionError(f"dtype={self.dtype!r} is invalid; choose one of: {', '.join(DTYPE_NAMES)}.")
            object.__setattr__(self, "dtype", DTYPE_NAMES[self.dtype])


def conversion_options(
    options: ConversionOptions | None = None,
    *,
    init: str | None = None,
    num_frequencies: int | None = None,
    omega0: float | None = None,
    dtype: torch.dtype | str | None = None,
) -> ConversionOptions:
    """``options`` (default ``ConversionOptions()``) with the keywords given (not None) in place of its fields: the
    one place the conversion entry points turn their arguments into options, validated once."""
    changes = {
        name: value
        for name, value in (("init", init), ("num_frequencies", num_frequencies), ("omega0", omega0), ("dtype", dtype))
        if value is not None
    }
    if options is None:
        return ConversionOptions(**changes)
    return dataclasses.replace(options, **changes) if changes else options


def check_source_config(config: dict[str, Any], where: str) -> None:
    """Name the field when a source config cannot describe a convertible model."""
    for field in _REQUIRED_FIELDS:
        value = config.get(field)
        if value is None:
            raise ConversionError(f"{where}: field {field!r} is missing; a Llama-style config.json needs it.")
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConversionError(f"{where}: field {field}={value!r} must be a positive integer.")
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    if not isinstance(kv_heads, int) or kv_heads <= 0 or heads % kv_heads != 0:
        raise ConversionError(
            f"{where}: num_attention_heads={heads} is not divisible by num_key_value_heads={kv_heads}; every key/value "
            "head must serve the same number of query heads (GQA). The config.json is inconsistent with the weights."
        )
    if config.get("head_dim") is None and config["hidden_size"] % heads != 0:
        raise ConversionError(
            f"{where}: hidden_size={config['hidden_size']} is not divisible by num_attention_heads={heads} and no "
            "head_dim is given; the head width is undefined."
        )


def build_qkmap_config(
    source_config: dict[str, Any], adapter: ArchitectureAdapter, options: ConversionOptions, where: str
) -> QKMapConfig:
    """The QK-MAP config of the converted model: the source's Llama fields plus the qk_map initialisation."""
    fields = adapter.config_fields(source_config)
    head_dim = fields.get("head_dim") or fields["hidden_size"] // fields["num_attention_heads"]
    fields.update(
        qk_mode="qk_map",
        qkmap_input_dim=head_dim,
        qkmap_num_frequencies=options.num_frequencies,
        architectures=["QKMapForCausalLM"],
    )
    if options.init == "exact":
        # a_sin sin(omega z) with a_sin = 1/omega is z to O((omega z)^2): the source attention in disguise.
        fields.update(
            qkmap_init="exact",
            qkmap_exact_frequency=float(options.omega0),
            qkmap_gain_parametrization="inverse_frequency",
            qkmap_logit_scale=head_dim**-0.5,
        )
    else:
        fields.update(qkmap_init="native")
    try:
        config = QKMapConfig(**fields)
    except (TypeError, ValueError) as error:
        raise ConversionError(f"{where}: the converted config is invalid: {' '.join(str(error).split())}") from error
    return config


def normalized_source_config(raw: dict[str, Any], where: str) -> dict[str, Any]:
    """The source config with its class defaults filled in (e.g. Mistral's sliding_window, Qwen2's bos/eos),
    through transformers' own config class, so the converted model sees what the source model saw."""
    from transformers import AutoConfig

    check_source_config(raw, where)
    model_type = raw.get("model_type")
    if model_type is None:
        raise ConversionError(f"{where}: field 'model_type' is missing.")
    try:
        config = AutoConfig.for_model(model_type, **{k: v for k, v in raw.items() if k != "model_type"})
    except Exception as error:  # unknown model type, or transformers' own strict validation
        text = " ".join(str(error).split())  # huggingface_hub's typed errors span lines: one line, field named
        raise ConversionError(f"{where}: transformers cannot read this {model_type!r} config: {text}") from error
    normalized = config.to_dict()
    normalized["architectures"] = raw.get("architectures")
    return normalized


def read_source_config(directory: Path) -> dict[str, Any]:
    """The raw ``config.json`` of a checkpoint folder (normalized later, once the architecture is known)."""
    path = directory / "config.json"
    if not path.is_file():
        raise ConversionError(
            f"{path}: config.json is missing; a Hugging Face checkpoint folder needs it to describe the model. "
            "For a GGUF file pass --gguf-file NAME (gguf_file=...)."
        )
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConversionError(f"{path}: not readable JSON ({error}).") from error
    if not isinstance(raw, dict):
        raise ConversionError(f"{path}: expected a JSON object.")
    return raw


def source_architecture(config: dict[str, Any]) -> str | None:
    architectures = config.get("architectures") or []
    return architectures[0] if architectures else None


__all__ = [
    "DEFAULT_OMEGA0",
    "DTYPE_NAMES",
    "INITS",
    "ConversionOptions",
    "build_qkmap_config",
    "check_source_config",
    "conversion_options",
    "normalized_source_config",
    "read_source_config",
    "source_architecture",
]
