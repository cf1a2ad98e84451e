"""`qkmap analyze` on tiny standard, qk_norm and qk_map models, with numbers checked independently.

- QK-Norm divides the input scale out: its sensitivity is zero up to RMSNorm's epsilon; QK-MAP's is not.
- For standard attention, scaling q and k by s scales the logits by s**2, so the expected attention change
  follows from the unscaled attention alone; the hook-based measurement must reproduce it.
- First-token mass must equal what `output_attentions=True` reports.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from qkmap_hf.analysis import AnalysisSettings, _windows, analyze_model
from qkmap_hf.tasks import data_file
from tests.eval_utils import cached_models, run_command, single_thread

_one_thread = pytest.fixture(autouse=True, scope="module")(single_thread)
SCALES = ("0.5", "2", "4")
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def analysis(tmp_path_factory):
    models = cached_models(tmp_path_factory)
    root = tmp_path_factory.mktemp("analysis")
    text = root / "tempest.txt"
    passages = [json.loads(line)["text"] for line in data_file("shakespeare_passages.jsonl").read_text().splitlines()]
    text.write_text("\n\n".join(passages[10:30]), encoding="utf-8")
    out = root / "out"
    code = run_command(
        "analyze",
        [
            str(models["qk_map"]),
            "--compare", str(models["standard"]), str(models["qk_norm"]),
            "--text", str(text),
            "--output-dir", str(out),
            "--max-tokens", "96",
            "--num-windows", "2",
            "--lengths", "128,256",
            "--needle-examples", "2",
            "--no-progress",
        ],
    )  # fmt: skip
    assert code == 0
    data = json.loads((out / "analysis.json").read_text())
    return {
        "data": data,
        "out": out,
        "text": text,
        "models": models,
        "by_mode": {m["qk_mode"]: m for m in data["models"]},
    }


@pytest.mark.slow  # reads the module's one `qkmap analyze` run of three models (~7 s)
def test_json_has_three_analyses_per_model(analysis):
    data = analysis["data"]
    assert data["format"] == "qkmap-analysis/1"
    assert [m["qk_mode"] for m in data["models"]] == ["qk_map", "standard", "qk_norm"]
    for model in data["models"]:
        assert model["num_layers"] == 2 and model["num_heads"] == 4
        scale = model["scale_sensitivity"]
        assert set(scale["per_head"]) == set(SCALES)
        assert all(len(rows) == 2 and all(len(r) == 4 for r in rows) for rows in scale["per_head"].values())
        first = model["first_token_mass"]
        assert first["first_token_is_bos"] is False and first["tokens"] == 96
        assert all(0.0 <= v <= 1.0 for row in first["per_head"] for v in row)
        contrast = model["evidence_contrast"]["by_length"]
        assert set(contrast) == {"128", "256"}
        for length, values in contrast.items():
            assert abs(values["tokens_mean"] - int(length)) <= 0.15 * int(length)
            assert len(values["per_head_log2_lift"]) == 2 and len(values["per_head_log2_lift"][0]) == 4
            assert 0.0 < values["mean_evidence_mass"] < 1.0
        assert model["path"] == str(analysis["models"][model["qk_mode"]].resolve())
    assert analysis["by_mode"]["qk_map"]["phase"]["layers"][0]["query"]["median"] > 0
    assert analysis["by_mode"]["standard"]["phase"] is None and analysis["by_mode"]["qk_norm"]["phase"] is None


@pytest.mark.slow  # reads the module's one `qkmap analyze` run of three models (~7 s)
def test_every_entry_reads_back_as_typed_results(analysis):
    """The readers (card, claim tables, summary line, plots) go through ModelDiagnostics: nothing is lost on the way."""
    from qkmap_hf.diagnostics import ModelDiagnostics

    for model in analysis["data"]["models"]:
        typed = ModelDiagnostics.from_dict(model)
        assert typed.to_dict() == model and list(typed.to_dict()) == list(model)
        assert (typed.phase is None) == (model["qk_mode"] != "qk_map")


@pytest.mark.slow  # reads the module's one `qkmap analyze` run of three models (~7 s)
def test_qk_norm_is_scale_invariant_and_qk_map_is_not(analysis):
    by_mode = analysis["by_mode"]
    for scale in SCALES:
        assert by_mode["qk_norm"]["scale_sensitivity"]["max"][scale] < 1e-3  # RMSNorm's epsilon only
        assert by_mode["qk_map"]["scale_sensitivity"]["mean"][scale] > 1e-2
        assert by_mode["standard"]["scale_sensitivity"]["mean"][scale] > 1e-2
    # larger rescaling moves QK-MAP's attention further
    qk_map = by_mode["qk_map"]["scale_sensitivity"]["mean"]
    assert qk_map["4"] > qk_map["2"]


@pytest.mark.slow  # reads the module's one `qkmap analyze` run of three models (~7 s)
def test_standard_scale_sensitivity_matches_logit_scaling(analysis):
    """Standard attention at scale s is softmax(s**2 * logits): recompute layer 0 from the unscaled attention."""
    path = analysis["models"]["standard"]
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    settings = AnalysisSettings(max_tokens=96, num_windows=2)
    ids, _ = _windows(tokenizer, analysis["text"].read_text(encoding="utf-8"), settings)
    with torch.no_grad():
        attention = model(input_ids=ids, output_attentions=True).attentions
    p = attention[0].double()
    result = analysis["by_mode"]["standard"]
    for scale in SCALES:
        s = float(scale)
        scaled = torch.softmax(s * s * torch.log(p), dim=-1)  # masked entries: log 0 = -inf stays 0
        tv = 0.5 * (scaled - p).abs().sum(-1)[:, :, 1:].mean(dim=(0, 2))
        assert result["scale_sensitivity"]["per_head"][scale][0] == pytest.approx(tv.tolist(), abs=1e-5)
    # first-token mass equals what output_attentions reports, for every layer
    expected = [layer[:, :, 1:, 0].mean(dim=(0, 2)).tolist() for layer in attention]
    for got, want in zip(result["first_token_mass"]["per_head"], expected, strict=True):
        assert got == pytest.approx(want, abs=1e-6)


@pytest.mark.slow  # reads the module's one `qkmap analyze` run of three models (~7 s)
def test_plots_written(analysis):
    out, data = analysis["out"], analysis["data"]
    for model in data["models"]:
        expected = {"scale_sensitivity", "first_token_mass", "evidence_contrast"} | (
            {"phase"} if model["phase"] else set()
        )
        assert set(model["plots"]) == expected
        for relative in model["plots"].values():
            assert (out / relative).read_bytes()[:8] == PNG
    assert set(data["comparison_plots"]) == {"scale_sensitivity", "first_token_mass", "evidence_contrast"}
    assert all((out / name).read_bytes()[:8] == PNG for name in data["comparison_plots"].values())
    assert not list(out.rglob("*.tmp.png")) and not list(out.glob(".analysis.json.*"))


@pytest.mark.slow  # reads the module's one `qkmap analyze` run of three models (~7 s)
def test_llama_source_model(analysis):
    """A plain LlamaForCausalLM (a conversion source) goes through the same analyses."""
    tokenizer = AutoTokenizer.from_pretrained(analysis["models"]["tokenizer"])
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    settings = AnalysisSettings(max_tokens=64, num_windows=1, context_lengths=(64,), needle_examples=1, scales=(2.0,))
    result = analyze_model(model, tokenizer, analysis["text"].read_text(), settings, progress=False, label="llama")
    assert result["model_type"] == "llama" and result["qk_mode"] == "standard"
    assert result["scale_sensitivity"]["mean"]["2"] > 0
    assert set(result["evidence_contrast"]["by_length"]) == {"64"}
    with pytest.raises(ValueError, match="fewer than one window"):
        analyze_model(model, tokenizer, "too short", settings, progress=False)


@pytest.mark.slow  # reads the module's one `qkmap analyze` run of three models (~7 s)
def test_summary_line_reports_every_measure_from_the_json(analysis):
    from qkmap_hf.commands.analyze import summary_line

    entry = analysis["by_mode"]["qk_map"]
    line = summary_line(entry)
    assert f"first-token mass {entry['first_token_mass']['mean']:.4f}" in line
    assert f"attention distance {entry['attention_distance']['mean']:.1f} tok" in line
    assert f"position-only logit share {entry['position_only_share']['mean']:.3f}" in line
    assert f"gain {entry['key_scale_sensitivity']['mean_gain']:+.4f}" in line
    assert "answer log2 lift" in line and line.endswith(f"phase regime: {entry['phase']['regime']}")
    assert "phase regime" not in summary_line(analysis["by_mode"]["standard"])


def test_evidence_contrast_cuts_a_long_prompt_from_the_start_so_the_question_stays(monkeypatch):
    """A prompt over the model's length loses distractors at its start; cut at its end it would lose question tokens."""
    import math

    from qkmap_hf.analysis import attention_layers, evidence_contrast
    from qkmap_hf.diagnostics import contrast as contrast_module
    from qkmap_hf.training.data import byte_level_tokenizer

    tokenizer = byte_level_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    )  # fmt: skip
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    prompts: list[list[int]] = []
    forward = contrast_module.forward_without_cache
    monkeypatch.setattr(
        contrast_module, "forward_without_cache", lambda m, ids: (prompts.append(ids[0].tolist()), forward(m, ids))[1]
    )
    settings = AnalysisSettings(max_tokens=64, num_windows=1, context_lengths=(200,), needle_examples=2, scales=(2.0,))
    layers = attention_layers(model)
    evidence_contrast(model, layers, tokenizer, settings, None, lambda n: None)
    full, prompts[:] = list(prompts), []
    assert len(full) == 2 and all(len(p) > 200 for p in full)  # the prompt template adds tokens to the requested length
    cut = evidence_contrast(model, layers, tokenizer, settings, 200, lambda n: None)["by_length"]["200"]
    assert [len(p) for p in prompts] == [200, 200]
    assert all(short == long[-200:] for short, long in zip(prompts, full, strict=True))  # the end, question included
    lifts = [v for row in cut["per_head_log2_lift"] for v in row]
    assert all(math.isfinite(v) for v in lifts) and 0 < cut["mean_evidence_mass"] < 1
