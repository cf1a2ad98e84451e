"""The heads Llama has, for QK-MAP: question answering and token classification, Auto-registered, named in the
saved folder's auto_map, and loading with trust_remote_code in a process without qkmap_hf."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import (
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

from qkmap_hf import (
    QKMapConfig,
    QKMapForQuestionAnswering,
    QKMapForSequenceClassification,
    QKMapForTokenClassification,
)
from tests.utils import run_clean_python, tiny_config_kwargs

IDS = torch.tensor([[5, 9, 2, 7, 1, 3, 8], [4, 4, 6, 2, 9, 1, 0]])
HEADS = {
    "AutoModelForQuestionAnswering": (AutoModelForQuestionAnswering, QKMapForQuestionAnswering),
    "AutoModelForTokenClassification": (AutoModelForTokenClassification, QKMapForTokenClassification),
    "AutoModelForSequenceClassification": (AutoModelForSequenceClassification, QKMapForSequenceClassification),
}


def _config(**overrides) -> QKMapConfig:
    return QKMapConfig(qk_mode="qk_map", num_labels=3, pad_token_id=0, **tiny_config_kwargs(**overrides))


def test_question_answering_scores_every_position_and_learns_from_spans():
    torch.manual_seed(0)
    model = QKMapForQuestionAnswering(_config())
    out = model(IDS, start_positions=torch.tensor([1, 2]), end_positions=torch.tensor([3, 5]))
    assert out.start_logits.shape == out.end_logits.shape == IDS.shape and torch.isfinite(out.loss)
    out.loss.backward()
    assert model.transformer.layers[0].self_attn.qk_map.log_frequency.grad.abs().sum() > 0


def test_token_classification_labels_every_token_and_ignores_minus_100():
    torch.manual_seed(0)
    model = QKMapForTokenClassification(_config())
    labels = torch.tensor([[0, 1, 2, 0, 1, 2, -100], [2, 2, 1, 1, 0, 0, -100]])
    out = model(IDS, labels=labels)
    assert out.logits.shape == (*IDS.shape, 3)
    by_hand = torch.nn.functional.cross_entropy(out.logits.view(-1, 3), labels.view(-1), ignore_index=-100)
    assert torch.allclose(out.loss, by_hand)


@pytest.mark.parametrize("auto_name", HEADS)
def test_each_head_is_auto_registered_and_saved_with_its_auto_map(auto_name, tmp_path):
    auto, cls = HEADS[auto_name]
    torch.manual_seed(0)
    model = cls(_config()).eval()
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["auto_map"][auto_name] == f"modeling_qkmap.{cls.__name__}"
    loaded = auto.from_pretrained(tmp_path).eval()
    assert type(loaded) is cls
    first = model(IDS)[0]
    assert torch.equal(loaded(IDS)[0], first)


@pytest.mark.slow
def test_the_heads_load_with_remote_code_in_a_process_without_qkmap_hf(tmp_path):
    expected = {}
    for auto_name, (_, cls) in HEADS.items():
        torch.manual_seed(0)
        model = cls(_config()).eval()
        model.save_pretrained(tmp_path / auto_name)
        expected[auto_name] = model(IDS)[0].tolist()
    code = f"""
import json, torch, transformers
out = {{}}
for name in {list(HEADS)!r}:
    model = getattr(transformers, name).from_pretrained({str(tmp_path)!r} + "/" + name, trust_remote_code=True).eval()
    out[name] = [type(model).__module__.startswith("transformers_modules"), model(torch.tensor({IDS.tolist()!r}))[0].tolist()]
print(json.dumps(out))
"""
    result = run_clean_python(code, cwd=tmp_path, env={"HF_MODULES_CACHE": str(tmp_path / "modules")})
    for auto_name, logits in expected.items():
        remote, got = result[auto_name]
        assert remote, f"{auto_name} did not load the folder's own code"
        assert torch.allclose(torch.tensor(got), torch.tensor(logits), atol=1e-5)
