"""One typed provenance record per kind: the files keep their names, keys and key order, old folders still load."""

from __future__ import annotations

import json

import pytest

from qkmap_hf.fileio import atomic_write_json
from qkmap_hf.provenance import (
    PROVENANCE_FILES,
    ConversionRecord,
    HealingRecord,
    TrainingRecord,
    load_provenance,
    record_from_dict,
)

# What the writers saved before the records were typed (keys and order of conversion/packaging.py, the trainer, heal).
OLD_CONVERSION = {
    "kind": "conversion", "source": "HuggingFaceTB/SmolLM2-135M", "source_architecture": "LlamaForCausalLM",
    "base_model": "HuggingFaceTB/SmolLM2-135M", "init": "canonical", "omega_0": None, "num_frequencies": 1,
    "gain_parametrization": "absolute", "input_norm": False, "dtype": "bfloat16", "qkmap_hf_version": "0.1.0",
    "transformers_version": "5.24.0", "torch_version": "2.13.0", "timestamp": "2026-11-30T10:00:00+00:00",
    "frequency_range": [0.1, 3.0], "gguf_file": "model.gguf", "verification": {"max_kl": 3.9},
}  # fmt: skip
OLD_TRAINING = {
    "command": "qkmap train", "options": {"model": "tiny", "max_steps": 60}, "resolved": {"batch_size": 8},
    "resumed_from": None, "world_size": 1, "parallel": {"world_size": 1}, "model": {"qk_mode": "qk_map"},
    "data": {"train_blocks": 10}, "train_metrics": {"train_loss": 2.5}, "eval_metrics": {"eval_loss": 2.4},
    "log_history": [{"step": 1, "loss": 5.5}], "wall_seconds": 12.5, "versions": {"torch": "2.13.0"},
}  # fmt: skip
OLD_HEALING = {
    "kind": "healing", "command": "qkmap heal", "converted_model": "conv", "source": "src",
    "recipe": {"alpha": 1.2}, "tokens_seen": 3072, "steps": 12, "final": {"regime": "periodic"},
    "gain_parametrization": "absolute",
}  # fmt: skip


@pytest.mark.parametrize(
    "cls, old", [(ConversionRecord, OLD_CONVERSION), (TrainingRecord, OLD_TRAINING), (HealingRecord, OLD_HEALING)]
)
def test_old_files_load_typed_and_save_back_identically(cls, old, tmp_path):
    atomic_write_json(tmp_path / PROVENANCE_FILES[cls.kind], old)
    record = load_provenance(tmp_path)[cls.kind]
    assert type(record) is cls and not record.extra
    assert list(record.to_dict().items()) == list(old.items())  # same keys, values and order
    (tmp_path / "again").mkdir()
    path = record.save(tmp_path / "again")
    assert path.name == PROVENANCE_FILES[cls.kind] and json.loads(path.read_text()) == old


def test_typed_fields_and_unknown_keys_are_kept():
    record = record_from_dict({**OLD_CONVERSION, "exact_frequency": 0.001, "license": "mit"})
    assert isinstance(record, ConversionRecord)
    assert (record.init, record.frequency_range, record.verification) == ("canonical", [0.1, 3.0], {"max_kl": 3.9})
    assert record.extra == {"exact_frequency": 0.001, "license": "mit"}
    assert record.to_dict()["license"] == "mit"
    # a fresh exact conversion writes omega_0 and base_model even when unset, the optional keys only when set
    fresh = ConversionRecord(source="src", init="exact", omega_0=1e-3).to_dict()
    assert fresh == {"kind": "conversion", "source": "src", "base_model": None, "init": "exact", "omega_0": 1e-3}


def test_other_kinds_and_bad_records():
    record = record_from_dict({"kind": "evaluation", "tasks": "hellaswag"})
    assert record.kind == "evaluation" and record.to_dict() == {"kind": "evaluation", "tasks": "hellaswag"}
    with pytest.raises(TypeError, match="must be a dict"):
        record_from_dict(["not", "a", "dict"])


def test_a_broken_file_is_named(tmp_path):
    (tmp_path / "qkmap_training.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(ValueError, match="qkmap_training.json"):
        load_provenance(tmp_path)
