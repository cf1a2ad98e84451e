"""File names this package reads and writes: one home for each, shared by conversion, training and publishing."""

from __future__ import annotations

SAFETENSORS_SINGLE_NAME = "model.safetensors"
SAFETENSORS_INDEX_NAME = "model.safetensors.index.json"
VERIFICATION_NAME = "verification.json"  # qkmap verify's report inside a model folder
# What produced a model folder, one typed record per kind (qkmap_hf/provenance.py), next to the weights.
PROVENANCE_FILES = {
    "conversion": "qkmap_conversion.json",
    "training": "qkmap_training.json",
    "healing": "qkmap_healing.json",
}
# Names of pickle-based checkpoint formats; content is checked too (qkmap_hf.safety.pickle_reason), whatever the name.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle", ".joblib", ".dill")
# Tokenizer and chat-template files: copied beside converted weights, and their presence means "has a tokenizer".
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)

__all__ = [
    "PICKLE_SUFFIXES",
    "SAFETENSORS_INDEX_NAME",
    "SAFETENSORS_SINGLE_NAME",
    "TOKENIZER_FILES",
    "VERIFICATION_NAME",
]
