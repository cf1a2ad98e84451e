# Copyright 2026 The qkmap-hf authors. Licensed under the Apache License, Version 2.0.
"""QK-MAP model configuration.

This file is copied into every saved checkpoint and loaded with ``trust_remote_code=True``: it must
import only torch and transformers (and sibling files, relatively).
"""

from __future__ import annotations

import difflib
import math

from transformers.activations import ACT2FN
from transformers.models.llama.configuration_llama import LlamaConfig

from .cos_blocks import COS_BLOCKS
from .gain_treatments import GAIN_TREATMENTS

QK_MODES = ("standard", "qk_norm", "qk_map")
QKMAP_FREQUENCY_SHARING = ("channel", "head")
QKMAP_GAIN_PARAMETRIZATIONS = ("absolute", "inverse_frequency")
QKMAP_INITS = ("native", "exact")
# How training treats the QK-MAP gains (qkmap_lab/notes/stability.md) and what the cos rows see: registries of the feature map.
QKMAP_GAIN_TREATMENTS = tuple(GAIN_TREATMENTS)
QKMAP_COS_BLOCKS = tuple(COS_BLOCKS)
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.1754943508222875e-38  # smallest normal float32: below it the weights underflow to 0 (or 1/x to inf)
QK_POSITION_PRIORS = ("none", "constant")
# qkmap_logit_scale="auto" (the default) resolves to this factor / sqrt(m) when the config is built: chosen on a
# disjoint report split (qkmap_lab/notes/paper-claims.md, "Defaults"). An explicit None keeps meaning 1/sqrt(m), so
# checkpoints saved before the change (qkmap_logit_scale: null) load unchanged.
QKMAP_AUTO_LOGIT_SCALE_FACTOR = 4.0
AUTO_MAP = {
    "AutoConfig": "configuration_qkmap.QKMapConfig",
    "AutoModel": "modeling_qkmap.QKMapModel",
    "AutoModelForCausalLM": "modeling_qkmap.QKMapForCausalLM",
    "AutoModelForSequenceClassification": "modeling_qkmap.QKMapForSequenceClassification",
    "AutoModelForQuestionAnswering": "modeling_qkmap.QKMapForQuestionAnswering",
    "AutoModelForTokenClassification": "modeling_qkmap.QKMapForTokenClassification",
}


class QKMapConfig(LlamaConfig):
    r"""Configuration of a Llama-style decoder whose queries and keys are built by one of three modes.

    Every Llama field keeps its name and meaning, so a Llama config converts by adding fields. The
    ``qk_mode`` field picks the query/key construction:

    - ``"standard"``: Llama attention, bit-for-bit (the honest baseline).
    - ``"qk_norm"``: per-head RMSNorm on queries and keys before RoPE (Qwen3 layout, ``q_norm``/``k_norm``).
    - ``"qk_map"``: the QK-MAP feature map ``phi(z) = concat_f [a_cos cos(omega z), a_sin sin(omega z)]``
      with block-wise RoPE; see ``docs/method.md``.

    QK-MAP fields (ignored by the other modes):

    - ``qkmap_input_dim`` (``m``): width of the projected ``z`` per head; ``None`` means ``head_dim``
      (the "wide" layout, keys of width ``2 F m``). ``head_dim // (2 F)`` is the "compact" layout.
    - ``qkmap_num_frequencies`` (``F``): frequency blocks; features have width ``2 F m``.
    - ``qkmap_learnable_frequencies``: train ``omega`` (stored as its logarithm) or freeze it.
    - ``qkmap_frequency_sharing``: ``"channel"`` (one ``omega`` per channel) or ``"head"`` (one per block).
    - ``qkmap_min_frequency`` / ``qkmap_max_frequency``: geometric grid of the native initialisation.
    - ``qkmap_logit_scale``: logit multiplier; ``"auto"`` (default) becomes ``4/sqrt(m)`` for the native init and
      ``1/sqrt(m)`` for the exact init when the config is built (stored as that number); ``None`` means
      ``1/sqrt(m)`` (what checkpoints saved before ``"auto"`` hold).
    - ``qkmap_gain_parametrization``: ``"absolute"`` (effective gain = stored gain) or
      ``"inverse_frequency"`` (effective gain = stored gain / omega, so a converted model starts at
      stored gain 1 and stays function-preserving while omega travels through the linear regime).
    - ``qkmap_init``: ``"native"`` (geometric omega, unit gains) or ``"exact"`` (every omega equals
      ``qkmap_exact_frequency``, sine gain ``1/omega``, cosine gain 0: the block computes ``z``).
    - ``qkmap_exact_frequency``: ``omega_0`` of the exact initialisation.
    - ``qkmap_input_norm``: a per-head RMSNorm (``q_norm``/``k_norm``, with weights) on ``z`` before the
      feature map, ``phi(RMSNorm(z))``: how a QK-Norm source (Qwen3) converts exactly.
    - ``qkmap_input_norm_power`` (``beta`` in [0, 1]): the norm divides by ``rms(z)^beta * r^(1 - beta)``
      (``r`` a per-head reference scale): 1 is the full norm, 0 a fixed scale that folds into the projection.
    - ``qkmap_rotate_cos_blocks``: RoPE-rotate the cos blocks (the default). ``False`` leaves them unrotated: their
      near-constant part then adds the same amount to every logit of a query (softmax-invariant), so the
      relative-position prior of the rotated constant block is removed (the "no prior" ablation).
    - ``qkmap_gain_treatment``: how training treats the gains, which bound the logits
      (``|logit| <= scale * ||a_q|| * ||a_k||``, see ``qkmap_lab/notes/stability.md``): ``"learned"`` (default: trained, no weight
      decay), ``"frozen"`` (kept at their initial values), ``"decayed"`` (trained with the weight matrices' learning
      rate and weight decay), ``"normalized"`` (each cos or sin row of ``m`` gains rescaled to RMS 1 in the forward
      pass: the bound is at most ``scale * 2 F m`` whatever training does; native init only).
    - ``qkmap_cos_block``: ``"phase"`` (default: ``a_cos cos(omega z)``) or ``"constant"``: the cos rows are the
      learnable constant ``a_cos`` (``z``-independent) rotated by RoPE, so only the sine rows see ``z``: the control
      that isolates magnitude from QK-MAP's relative-position prior (qkmap_lab/notes/synthetic-tasks.md).
    - ``qkmap_recompute_projections``: training maps ``q_proj``/``k_proj``'s outputs in one autograd node that
      keeps the layer input and recomputes the projections in the backward pass, instead of keeping ``z``: fewer
      saved activation bytes for one more pair of projection matmuls (docs/performance.md). ``None`` (default):
      on where the keys are wider than ``head_dim`` (the wide layout, whose saved bytes it brings under 1.15x
      standard's), off in the compact layout (already at standard's bytes). Values are the same; adapters (peft),
      quantized projections, hooks, autocast, ``qkmap_input_norm`` and gradient checkpointing (which keeps only the
      layer inputs anyway) keep the plain path.
    - ``qkmap_compile_feature_map``: run the feature map's passes (not decoding's one-token path) as plain expressions
      compiled with ``torch.compile`` on first use, which fuses its elementwise chain into a few passes over memory
      (docs/performance.md: the map's cost in a training step, eager against compiled). Off by default: the first
      call of each shape compiles (seconds), and inductor needs a C++ compiler on a CPU; where compiling fails the
      model warns once and runs the eager map. Values equal the eager map's up to float rounding.
    - ``qkmap_fused_feature_map``: on a CPU, run the feature map (training, prefill and decoding) as one fused kernel,
      a pass over memory each way instead of ~20 elementwise ops (docs/performance.md: "The fused feature map on
      CPUs"), wherever it is loaded: ``import qkmap_hf`` loads this machine's build (``qkmap kernels`` builds it;
      setup and training on a CPU do too). Where it is not loaded (a checkpoint used without qkmap_hf, no C++
      compiler), and for float64 or GPU tensors, the eager map (or the compiled one) runs. On by default; values
      equal the eager map's up to float rounding. It comes before ``qkmap_compile_feature_map`` where both apply.
    - ``qkmap_fused_attention``: on a CPU, with sdpa, run causal attention whose keys are wider than its values (the
      wide layout) as one kernel that keeps the values at their width, instead of sdpa with values zero-padded to the
      key width (docs/performance.md: "Causal attention for wide keys on CPUs"). Loaded with the fused feature map;
      float32, no mask tensor and as many queries as keys (training, prefill); elsewhere sdpa with padded values
      runs. On by default; values equal sdpa's up to float rounding.

    Fields of every mode (ablations and tuning knobs, see ``docs/method.md``):

    - ``logit_scale_multiplier``: multiplies the mode's default logit scale (``1/sqrt(head_dim)``, or
      ``qkmap_logit_scale``/``1/sqrt(m)``), so every mode has a temperature knob; 1 keeps Llama bit for bit.
    - ``qk_position_prior`` (``standard``/``qk_norm`` only): ``"constant"`` appends to every query and key head one
      learnable constant block of width ``head_dim`` rotated by RoPE: QK-MAP's cos block at ``z = 0``, a pure
      relative-position logit. ``"none"`` (default) is the plain mode.
    """

    model_type = "qkmap"
    keys_to_ignore_at_inference = ["past_key_values", "cache"]

    qk_mode: str = "qk_map"
    qkmap_input_dim: int | None = None
    qkmap_num_frequencies: int = 1
    qkmap_learnable_frequencies: bool = True
    qkmap_frequency_sharing: str = "channel"
    qkmap_min_frequency: float = 0.1
    qkmap_max_frequency: float = 3.0
    qkmap_logit_scale: float | str | None = "auto"
    qkmap_gain_parametrization: str = "absolute"
    qkmap_init: str = "native"
    qkmap_exact_frequency: float = 1e-3
    qkmap_input_norm: bool = False
    qkmap_input_norm_power: float = 1.0
    qkmap_rotate_cos_blocks: bool = True
    qkmap_gain_treatment: str = "learned"
    qkmap_cos_block: str = "phase"
    qkmap_recompute_projections: bool | None = None
    qkmap_compile_feature_map: bool = False
    qkmap_fused_feature_map: bool = True
    qkmap_fused_attention: bool = True
    logit_scale_multiplier: float = 1.0
    qk_position_prior: str = "none"

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        self.validate_known_qkmap_keys(vars(self))
        m = self.resolved_qkmap_input_dim
        if self.qkmap_logit_scale == "auto" and isinstance(m, int) and m > 0:  # else validation names the bad width
            # exact init reproduces standard attention, whose scale is 1/sqrt(m); native init: the measured factor
            factor = 1.0 if self.qkmap_init == "exact" else QKMAP_AUTO_LOGIT_SCALE_FACTOR
            self.qkmap_logit_scale = factor / m**0.5
        self.validate_qkmap()
        self.validate_qkmap_input_norm()
        # Saved checkpoints load without qkmap_hf through these entries and the files copied beside them.
        self.auto_map = dict(AUTO_MAP)

    @classmethod
    def get_config_dict(cls, pretrained_model_name_or_path, **kwargs):
        """Refuse a checkpoint of another model type: its weights do not fit QK-MAP attention without conversion."""
        config_dict, kwargs = super().get_config_dict(pretrained_model_name_or_path, **kwargs)
        model_type = config_dict.get("model_type")
        if model_type not in (None, cls.model_type):
            raise ValueError(
                f"{pretrained_model_name_or_path} is a `{model_type}` checkpoint, not QK-MAP (model_type "
                f"'{cls.model_type}'); convert it first with `qkmap convert {pretrained_model_name_or_path} DST`, "
                "or load it with AutoModelForCausalLM."
            )
        return config_dict, kwargs

    @classmethod
    def qkmap_field_names(cls) -> list[str]:
        """The ``qkmap_*`` fields this class knows."""
        return [name for name in cls.__annotations__ if name.startswith("qkmap_")]

    @classmethod
    def boolean_field_names(cls, nullable: bool = False) -> list[str]:
        """Every boolean field, this class's and the inherited Llama ones; ``nullable``: the ``bool | None`` fields
        instead, which also take None (the default in effect, as their ``resolved_*`` property says)."""
        annotations = ("bool | None",) if nullable else ("bool", "<class 'bool'>")
        names = []
        for klass in reversed(cls.__mro__):
            names += [n for n, a in vars(klass).get("__annotations__", {}).items() if str(a) in annotations]
        return sorted(set(names))

    @classmethod
    def validate_known_qkmap_keys(cls, keys) -> None:
        """A ``qkmap_*`` key this class does not know is a misspelt field (silently ignored otherwise): refused
        with the closest known name."""
        known = cls.qkmap_field_names()
        for key in keys:
            if isinstance(key, str) and key.startswith("qkmap_") and key not in known:
                close = difflib.get_close_matches(key, known, n=1, cutoff=0.5)
                hint = f"did you mean {close[0]}?" if close else f"known: {', '.join(known)}."
                raise ValueError(f"QKMapConfig has no field {key!r}; {hint}")

    def validate_boolean_fields(self) -> None:
        """Booleans only: a string such as "no" is truthy and would switch a feature on. A nullable one also takes
        None (its default in effect)."""
        for nullable, allowed in ((False, "true or false"), (True, "true, false or null")):
            booleans = type(self).boolean_field_names(nullable)
            for name in [n for n in type(self).qkmap_field_names() if n in booleans]:
                value = getattr(self, name)
                if not (isinstance(value, bool) or (nullable and value is None)):
                    raise ValueError(f"QKMapConfig.{name}={value!r} is invalid; use {allowed}.")

    def validate_float_fields(self) -> None:
        """Every float field of this class (present and future): a real number, finite, usable in float32."""
        for name, annotation in type(self).__annotations__.items():
            if "float" not in str(annotation):
                continue
            value = getattr(self, name, None)
            if (value is None and "None" in str(annotation)) or value == "auto":
                continue  # "auto" is left only where the width m is invalid, which validate_qkmap names
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"QKMapConfig.{name}={value!r} is invalid; it must be a number ({annotation}).")
            if not math.isfinite(value):
                raise ValueError(f"QKMapConfig.{name}={value!r} is invalid; it must be a finite number.")
            if value != 0 and not FLOAT32_TINY <= abs(value) <= FLOAT32_MAX:
                raise ValueError(
                    f"QKMapConfig.{name}={value!r} is invalid; its magnitude must lie between {FLOAT32_TINY:.3g} and "
                    f"{FLOAT32_MAX:.3g} (float32 weights and 1/{name} must be finite and non-zero)."
                )

    def validate_qkmap(self) -> None:
        """Raise ``ValueError`` naming the first invalid field and what it accepts."""

        def choice(field: str, allowed: tuple[str, ...]) -> None:
            value = getattr(self, field)
            if value not in allowed:
                raise ValueError(f"QKMapConfig.{field}={value!r} is invalid; allowed values: {', '.join(allowed)}.")

        def positive(field: str, value, kind: type = int) -> None:
            if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int) or value <= 0:
                raise ValueError(f"QKMapConfig.{field}={value!r} is invalid; it must be a positive {kind.__name__}.")

        self.validate_boolean_fields()
        self.validate_float_fields()
        choice("qk_mode", QK_MODES)
        if self.hidden_act not in ACT2FN:
            close = difflib.get_close_matches(str(self.hidden_act), list(ACT2FN), n=1)
            raise ValueError(
                f"QKMapConfig.hidden_act={self.hidden_act!r} is not an activation transformers knows"
                + (f"; did you mean {close[0]}?" if close else ".")
            )
        choice("qkmap_frequency_sharing", QKMAP_FREQUENCY_SHARING)
        choice("qkmap_gain_parametrization", QKMAP_GAIN_PARAMETRIZATIONS)
        choice("qkmap_init", QKMAP_INITS)
        choice("qkmap_gain_treatment", QKMAP_GAIN_TREATMENTS)
        choice("qkmap_cos_block", QKMAP_COS_BLOCKS)
        if GAIN_TREATMENTS[self.qkmap_gain_treatment].native_init_only and self.qkmap_init == "exact":
            raise ValueError(
                f"QKMapConfig.qkmap_gain_treatment={self.qkmap_gain_treatment!r} needs qkmap_init='native': the exact "
                "init's zero and 1/omega gains are not RMS 1 per row, so normalizing them would change the converted "
                "function."
            )
        for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            positive(field, getattr(self, field))
        positive("num_key_value_heads", self.num_key_value_heads)
        positive("head_dim", self.head_dim)
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"QKMapConfig.num_attention_heads={self.num_attention_heads} is not divisible by "
                f"num_key_value_heads={self.num_key_value_heads}; choose num_key_value_heads among the divisors of "
                f"{self.num_attention_heads}."
            )
        positive("qkmap_num_frequencies", self.qkmap_num_frequencies)
        if self.qkmap_input_dim is not None:
            positive("qkmap_input_dim", self.qkmap_input_dim)
        if self.resolved_qkmap_input_dim % 2 != 0:
            raise ValueError(
                f"QKMapConfig.qkmap_input_dim={self.resolved_qkmap_input_dim} must be even: RoPE rotates channel "
                "pairs inside each block."
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"QKMapConfig.head_dim={self.head_dim} must be even: RoPE rotates channel pairs.")
        positive("qkmap_min_frequency", self.qkmap_min_frequency, float)
        positive("qkmap_max_frequency", self.qkmap_max_frequency, float)
        positive("qkmap_exact_frequency", self.qkmap_exact_frequency, float)
        if self.qkmap_min_frequency > self.qkmap_max_frequency:
            raise ValueError(
                f"QKMapConfig.qkmap_min_frequency={self.qkmap_min_frequency} exceeds qkmap_max_frequency="
                f"{self.qkmap_max_frequency}; the native grid runs from min to max."
            )
        if self.qkmap_logit_scale is not None:
            positive("qkmap_logit_scale", self.qkmap_logit_scale, float)
        self.validate_ablations(positive)

    def validate_ablations(self, positive) -> None:
        """The ablation and tuning fields (``logit_scale_multiplier``, ``qk_position_prior``); the cos-block rotation
        is a boolean, which ``validate_boolean_fields`` checks."""
        positive("logit_scale_multiplier", self.logit_scale_multiplier, float)
        if self.qk_position_prior not in QK_POSITION_PRIORS:
            raise ValueError(
                f"QKMapConfig.qk_position_prior={self.qk_position_prior!r} is invalid; allowed values: "
                f"{', '.join(QK_POSITION_PRIORS)}."
            )
        if self.qk_position_prior != "none" and self.qk_mode == "qk_map":
            raise ValueError(
                f"QKMapConfig.qk_position_prior={self.qk_position_prior!r} applies to qk_mode standard or qk_norm; "
                "qk_map carries its prior in the rotated cos blocks (set qkmap_rotate_cos_blocks=False to remove it)."
            )

    def validate_qkmap_input_norm(self) -> None:
        """The input norm exists in the qk_map mode only, with a power in [0, 1] (that it is a boolean,
        ``validate_boolean_fields`` checked before)."""
        if self.qkmap_input_norm and self.qk_mode != "qk_map":
            raise ValueError(
                f"QKMapConfig.qkmap_input_norm=True needs qk_mode='qk_map' (got {self.qk_mode!r}); qk_norm mode "
                "already normalizes queries and keys."
            )
        power = self.qkmap_input_norm_power
        if isinstance(power, bool) or not isinstance(power, (int, float)) or not 0.0 <= power <= 1.0:
            raise ValueError(
                f"QKMapConfig.qkmap_input_norm_power={power!r} is invalid; it must be a number in [0, 1] "
                "(1: full RMSNorm, 0: a fixed per-head scale)."
            )

    @property
    def resolved_qkmap_input_dim(self) -> int:
        """``m`` in effect: ``qkmap_input_dim``, or ``head_dim`` when it is None (the width of ``z`` per head and of
        each sin/cos block). The one name of ``m`` besides the field itself."""
        return self.qkmap_input_dim if self.qkmap_input_dim is not None else self.head_dim

    @property
    def resolved_qkmap_recompute_projections(self) -> bool:
        """``qkmap_recompute_projections`` in effect (qk_map mode only): the field, or where it is None, whether the
        keys are wider than ``head_dim`` (the wide layout keeps ``z`` on top of keys twice standard's width; the
        compact one does not need the trade)."""
        if self.qk_mode != "qk_map":
            return False
        if self.qkmap_recompute_projections is not None:
            return self.qkmap_recompute_projections
        return self.query_key_dim > self.head_dim

    @property
    def qkmap_feature_dim_per_block(self) -> int:
        """Deprecated old name of ``resolved_qkmap_input_dim`` (kept for code saved with older checkpoints)."""
        return self.resolved_qkmap_input_dim

    @property
    def query_key_dim(self) -> int:
        """Width of the queries and keys that reach the attention kernel (and the key cache), as the query/key
        constructions of this config build them (qk_registry.py)."""
        from .qk_registry import query_key_width  # the registry imports the constructions, which use this config

        return query_key_width(self)

    @property
    def projection_dim(self) -> int:
        """Width per head of ``q_proj``/``k_proj`` outputs, set by the position construction: ``m``
        (``resolved_qkmap_input_dim``) in qk_map mode, else ``head_dim``. A layer width, not another name of ``m``."""
        from .qk_registry import position_construction

        return position_construction(self).projection_dim(self)


__all__ = ["QKMAP_GAIN_TREATMENTS", "QKMapConfig", "QK_MODES", "QK_POSITION_PRIORS"]
