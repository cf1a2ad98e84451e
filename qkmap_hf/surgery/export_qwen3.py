"""Save a QK-MAP model trained in ``qk_norm`` mode as a genuine ``Qwen3ForCausalLM`` checkpoint.

``qk_norm`` mode is Qwen3's attention (per-head RMSNorm on queries and keys before RoPE, parameter names
included), so the weights move over unchanged. The result has ``model_type: qwen3``, no ``auto_map`` and
no model code: transformers loads it on its own, and it is a real QK-Norm source for the conversion.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..errors import ConversionError
from ..fileio import atomic_directory
from ..safety import check_destination

_SHARED_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "max_position_embeddings",
    "initializer_range",
    "rms_norm_eps",
    "tie_word_embeddings",
    "rope_parameters",
    "attention_bias",
    "attention_dropout",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
)


@torch.no_grad()
def save_qk_norm_as_qwen3(
    model: torch.nn.Module, dst: str | os.PathLike, tokenizer=None, overwrite: bool = False
) -> Path:
    """Write ``model`` (a ``QKMapForCausalLM`` with ``qk_mode="qk_norm"``) to ``dst`` as ``Qwen3ForCausalLM``.

    The Qwen3 model is checked to compute the same logits bit for bit before anything is written.
    """
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from transformers.initialization import no_init_weights

    config = model.config
    if getattr(config, "qk_mode", None) != "qk_norm" or getattr(config, "mlp_bias", False):
        raise ConversionError(
            f"qk_mode={getattr(config, 'qk_mode', None)!r}, mlp_bias={getattr(config, 'mlp_bias', None)}: only a "
            "QK-MAP model in qk_norm mode without MLP biases has Qwen3's layout."
        )
    qwen3_config = Qwen3Config(
        **{field: getattr(config, field) for field in _SHARED_FIELDS},
        use_sliding_window=False,
        sliding_window=None,
        max_window_layers=config.num_hidden_layers,
        architectures=["Qwen3ForCausalLM"],
    )
    with no_init_weights():
        qwen3 = Qwen3ForCausalLM(qwen3_config)
    state = model.state_dict()
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    result = qwen3.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or result.unexpected_keys:
        raise ConversionError(f"Qwen3 layout mismatch: missing {missing[:4]}, unexpected {result.unexpected_keys[:4]}.")
    if config.tie_word_embeddings:
        qwen3.tie_weights()
    qwen3.to(next(model.parameters()).dtype).eval()
    ids = torch.arange(min(16, config.vocab_size)).unsqueeze(0) % config.vocab_size
    was_training = model.training
    model.eval()
    same = torch.equal(model(ids.to(model.device)).logits.cpu(), qwen3(ids).logits)
    model.train(was_training)
    if not same:
        raise ConversionError("internal: the Qwen3 model does not reproduce the qk_norm model's logits.")
    if getattr(model, "generation_config", None) is not None:
        qwen3.generation_config = model.generation_config
    dst = Path(dst).expanduser().absolute()
    check_destination([], dst, overwrite)
    with atomic_directory(dst, overwrite) as tmp:
        qwen3.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    return dst


__all__ = ["save_qk_norm_as_qwen3"]
