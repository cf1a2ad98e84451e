"""The diagnostics as units (qkmap_hf.diagnostics): one phase recorder, one contrast formula, typed results.

- On a converted Qwen3 (an input norm in front of the feature map) ``qkmap analyze`` and ``qkmap verify`` report
  the same phase statistics for the same tokens, and they are not the phases of the ``q_proj`` output.
- Every log2 lift of the package (the needle contrasts of analyze, the MQAR contrast of task_probes) is the one
  function ``attention_measures.log2_lift``; a contrast over several query rows is the mean of its one-row lifts.
- A typed result reads back what it wrote.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from qkmap_hf import attention_measures
from qkmap_hf.analysis import AnalysisSettings, analyze_model
from qkmap_hf.diagnostics import ModelDiagnostics, PhaseStatistics, contrast
from qkmap_hf.phases import input_dim_of, phase_magnitudes, quantiles
from qkmap_hf.training.data import byte_level_tokenizer
from tests.eval_utils import single_thread

_one_thread = pytest.fixture(autouse=True, scope="module")(single_thread)
PACKAGE = Path(__file__).resolve().parents[2] / "qkmap_hf"
TEXT = "Full fathom five thy father lies; of his bones are coral made; those are pearls that were his eyes. " * 3


@pytest.fixture(scope="module")
def converted_qwen3(tmp_path_factory):
    from qkmap_hf.modeling.modeling_qkmap import QKMapForCausalLM
    from qkmap_hf.packaging import convert_checkpoint

    from .test_conversion_qwen3 import tiny_qwen3

    root = tmp_path_factory.mktemp("qwen3_phases")
    source = tiny_qwen3(vocab_size=257)
    source.save_pretrained(root / "src")
    convert_checkpoint(root / "src", root / "dst", progress=False)
    converted = QKMapForCausalLM.from_pretrained(root / "dst", attn_implementation="eager", dtype=torch.float32)
    assert converted.config.qkmap_input_norm
    return source, converted.eval()


def test_analyze_and_verify_report_the_same_phases_of_a_converted_qwen3(converted_qwen3):
    from qkmap_hf.verify import verify_conversion

    source, converted = converted_qwen3
    tokenizer = byte_level_tokenizer()
    tokens = 96
    report = verify_conversion(source, converted, TEXT, max_tokens=tokens, generate_tokens=1, tokenizer=tokenizer)
    settings = AnalysisSettings(max_tokens=tokens, num_windows=1, context_lengths=(160,), needle_examples=1,
                                scales=(2.0,))  # fmt: skip
    entry = analyze_model(converted, tokenizer, TEXT, settings, progress=False)
    analyzed = ModelDiagnostics.from_dict(entry).phase
    verified = PhaseStatistics.from_dict(report.phase)
    assert analyzed is not None and len(analyzed.layers) == converted.config.num_hidden_layers
    for ours, theirs in zip(analyzed.layers, verified.layers, strict=True):
        assert ours.layer == theirs.layer
        for role in ("query", "key"):
            assert getattr(ours, role) == pytest.approx(getattr(theirs, role), rel=1e-6)
    assert analyzed.regime_label == verified.regime_label

    # the z of the feature map (after the input norm) is not the q_proj output: phases of that differ
    attention = converted.model.layers[0].self_attn
    kept = {}
    handle = attention.q_proj.register_forward_hook(lambda _m, _i, out: kept.__setitem__("z", out.detach()))
    with torch.no_grad():
        converted(input_ids=tokenizer(TEXT, return_tensors="pt").input_ids[:, :tokens])
    handle.remove()
    before_norm = quantiles(phase_magnitudes(kept["z"], attention.qk_map.frequency(), input_dim_of(attention)))
    assert before_norm["median"] != pytest.approx(analyzed.layers[0].query.median, rel=1e-3)


def test_one_log2_lift_for_every_contrast():
    """The needle contrasts and the MQAR contrast call the same function; no other module computes a log2 lift."""
    assert contrast.log2_lift is attention_measures.log2_lift
    computing = sorted(
        path.relative_to(PACKAGE).as_posix()
        for path in PACKAGE.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.Attribute) and node.attr == "log2"
    )
    assert computing == ["attention_measures.py"]


def test_a_contrast_over_several_rows_is_the_mean_of_one_row_lifts():
    """analyze's question rows (one call on ``(heads, queries, keys)``) and task_probes' per-query calls agree."""
    torch.manual_seed(0)
    rows = torch.rand(3, 5, 40).softmax(-1)
    target = torch.zeros(40, dtype=torch.bool)
    target[[4, 5, 6]] = True
    reference = torch.zeros(40, dtype=torch.bool)
    reference[10:30] = True
    together = attention_measures.log2_lift(rows, target, reference).per_head
    one_by_one = torch.tensor(
        [attention_measures.log2_lift(rows[:, q], target, reference).per_head for q in range(5)], dtype=torch.float64
    )
    assert together == pytest.approx(one_by_one.mean(0).tolist(), abs=1e-12)


def test_a_prompt_contrast_is_log2_lift_of_the_attention_rows():
    """diagnostics.contrast on one prompt equals log2_lift applied to output_attentions' question rows."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from qkmap_hf.diagnostics.hooks import attention_layers

    torch.manual_seed(1)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)  # fmt: skip
    config._attn_implementation = "eager"
    model = LlamaForCausalLM(config).eval()
    kinds = ["bos"] + ["distractor"] * 20 + ["evidence"] * 3 + ["value"] * 2 + ["distractor"] * 10 + ["question"] * 4
    ids = torch.randint(0, 64, (len(kinds),)).tolist()
    for kind in (contrast.EVIDENCE, contrast.ANSWER):
        lifts, _ = contrast.prompt_contrast(model, attention_layers(model), ids, kinds, kind)
        with torch.no_grad():
            attentions = model(torch.tensor([ids]), output_attentions=True).attentions
        target = torch.tensor([k in kind.targets for k in kinds])
        reference = torch.tensor([k == "distractor" for k in kinds])
        queries = kind.query_rows(kinds)
        expected = [attention_measures.log2_lift(a[0][:, queries], target, reference).per_head for a in attentions]
        for got, want in zip(lifts, expected, strict=True):
            assert got == pytest.approx(want, abs=1e-6)


def test_typed_results_read_back_what_they_wrote():
    from qkmap_hf.modeling.modeling_qkmap import QKMapForCausalLM
    from qkmap_hf.training.presets import preset_config

    tokenizer = byte_level_tokenizer()
    torch.manual_seed(0)
    model = QKMapForCausalLM(preset_config("tiny", "qk_map", vocab_size=len(tokenizer), max_position_embeddings=256))
    settings = AnalysisSettings(scales=(0.5, 2.0), max_tokens=48, num_windows=2, context_lengths=(160,),
                                needle_examples=1)  # fmt: skip
    entry = analyze_model(model, tokenizer, TEXT, settings, progress=False, label="tiny")
    entry["path"] = "somewhere"
    result = ModelDiagnostics.from_dict(entry)
    assert result.to_dict() == entry and list(result.to_dict()) == list(entry)
    headlines = result.headlines()
    assert set(headlines) == set(result.measures())
    assert headlines["first_token_mass"].value == entry["first_token_mass"]["mean"]
    assert headlines["scale_sensitivity"].value == entry["scale_sensitivity"]["mean"]["0.5"]
    assert result.phase is not None and result.phase.regime == entry["phase"]["regime"]


def test_one_regime_rule_for_analyze_and_verify():
    """The regime follows the pooled p90 (verify's and heal's rule) where a recorder measured it, and the label a
    file states where it is read back; the per-role maximum (which would say periodic here) is only the fallback."""
    from qkmap_hf.diagnostics.phases import PhaseStatistics
    from qkmap_hf.phases import describe, regime

    role = {"median": 0.5, "mean": 0.5, "max": 2.0}
    layer = {"layer": 0, "query": {**role, "p90": 1.2}, "key": {**role, "p90": 0.9}, "phase_p90": 0.95}
    summary = {"layers": [layer], "phase_p90": [0.95], "regime": regime([0.95])}  # as PhaseRecorder.summary() says
    measured = PhaseStatistics.from_dict(summary)
    assert measured.regime_label == summary["regime"] == "transitional"
    written = measured.to_dict()
    assert "phase_p90" not in written["layers"][0] and written["regime"] == describe("transitional")
    assert PhaseStatistics.from_dict(written).regime_label == "transitional"  # read back: the label it states
    legacy = {"layers": [{k: v for k, v in layer.items() if k != "phase_p90"}]}
    assert PhaseStatistics.from_dict(legacy).regime_label == "periodic"  # no pooled value, no label: the roles' rule
