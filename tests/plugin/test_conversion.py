"""Conversion of tiny random Llama, Mistral and Qwen2 checkpoints: exactness, layout, reload without qkmap_hf.

Every model is built here, saved with transformers, converted once per module (fixtures) and then compared
with its source on real numbers: per-token KL, logits, greedy tokens.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

import qkmap_hf
from qkmap_hf.conversion import SUPPORTED_ARCHITECTURES, convert_model
from qkmap_hf.modeling.modeling_qkmap import QKMapFeatureMap
from qkmap_hf.packaging import convert_checkpoint
from tests.utils import kl_per_token, run_clean_python, tiny_config_kwargs

REPO_ROOT = Path(__file__).resolve().parents[2]
KL_BOUND = 1e-6
SEQ_LEN = 96
GREEDY_TOKENS = 64
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
FAKE_TOKENIZER_FILES = {"tokenizer.json": '{"fake": "tokenizer"}', "tokenizer_config.json": '{"model_max_length": 256}'}


def _tiny(kind: str) -> torch.nn.Module:
    """A tiny random model; initializer_range 0.1 makes predictions peaked enough for a meaningful greedy test."""
    torch.manual_seed({"llama": 1, "mistral": 2, "qwen2": 3}[kind])
    if kind == "llama":  # GQA 4/2, llama3 rope scaling, untied
        model = LlamaForCausalLM(LlamaConfig(**tiny_config_kwargs(rope_scaling=LLAMA3_ROPE, initializer_range=0.1)))
    elif kind == "mistral":  # full attention (sliding_window null), untied
        model = MistralForCausalLM(MistralConfig(**tiny_config_kwargs(sliding_window=None, initializer_range=0.1)))
    else:  # q/k/v biases (made non-zero), tied embeddings
        model = Qwen2ForCausalLM(Qwen2Config(**tiny_config_kwargs(initializer_range=0.1, tie_word_embeddings=True)))
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(".bias"):
                    param.normal_(std=0.3)
    return model.eval()


def greedy(model: torch.nn.Module, prompt: torch.Tensor, tokens: int = GREEDY_TOKENS) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(prompt, do_sample=False, max_new_tokens=tokens, min_new_tokens=tokens, pad_token_id=0)


def load_tensors(folder: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118
                tensors[name] = handle.get_tensor(name)
    return tensors


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    return torch.randint(0, 256, (1, SEQ_LEN), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict[str, dict]:
    """kind -> {model, src, dst}: each tiny model saved (Mistral sharded) and converted with init=exact."""
    root = tmp_path_factory.mktemp("tiny")
    out = {}
    for kind in ("llama", "mistral", "qwen2"):
        model = _tiny(kind)
        src, dst = root / f"{kind}-src", root / f"{kind}-qkmap"
        model.save_pretrained(src, **({"max_shard_size": "60KB"} if kind == "mistral" else {}))
        for name, text in FAKE_TOKENIZER_FILES.items():
            (src / name).write_text(text)
        convert_checkpoint(src, dst, init="exact", progress=False, base_model=f"tiny-org/{kind}")
        out[kind] = {"model": model, "src": src, "dst": dst}
    return out


KINDS = ("llama", "mistral", "qwen2")


@pytest.mark.parametrize("kind", KINDS)
def test_exact_conversion_preserves_the_function(converted, ids, kind):
    entry = converted[kind]
    model = AutoModelForCausalLM.from_pretrained(entry["dst"], dtype=torch.float32).eval()
    assert type(model).__name__ == "QKMapForCausalLM" and model.config.qk_mode == "qk_map"
    with torch.no_grad():
        source_logits = entry["model"](ids).logits[0]
        converted_logits = model(ids).logits[0]
    kl = kl_per_token(source_logits, converted_logits)
    assert kl.max().item() <= KL_BOUND, f"{kind}: max KL {kl.max().item():.3e}"
    assert (source_logits - converted_logits).abs().max().item() < 1e-2
    # predictions are far from uniform (1/256), so identical greedy tokens mean something
    assert source_logits.softmax(-1).max(-1).values.mean() > 4 / 256
    prompt = ids[:, :16]
    assert torch.equal(greedy(entry["model"], prompt), greedy(model, prompt))


@pytest.mark.parametrize("kind", KINDS)
def test_output_folder(converted, kind):
    entry = converted[kind]
    src, dst = entry["src"], entry["dst"]
    config = json.loads((dst / "config.json").read_text())
    source_config = entry["model"].config
    head_dim = 64 // 4  # tiny_config_kwargs: hidden 64, 4 heads
    assert config["model_type"] == "qkmap" and config["architectures"] == ["QKMapForCausalLM"]
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_qkmap.QKMapForCausalLM"
    assert config["qkmap_init"] == "exact" and config["qkmap_gain_parametrization"] == "inverse_frequency"
    assert config["qkmap_exact_frequency"] == 1e-3 and config["qkmap_num_frequencies"] == 1
    assert config["qkmap_input_dim"] == head_dim and math.isclose(config["qkmap_logit_scale"], head_dim**-0.5)
    for field in (
        "hidden_size",
        "num_attention_heads",
        "num_key_value_heads",
        "tie_word_embeddings",
        "rope_parameters",
    ):
        assert config[field] == getattr(source_config, field), field
    assert config["attention_bias"] is (kind == "qwen2")
    for name in ("configuration_qkmap.py", "modeling_qkmap.py", "attention_qkmap.py", "feature_map_qkmap.py"):
        assert (dst / name).read_bytes() == (Path(qkmap_hf.__file__).parent / "modeling" / name).read_bytes()
    for name in (*FAKE_TOKENIZER_FILES, "generation_config.json"):
        assert (dst / name).read_bytes() == (src / name).read_bytes(), name
    provenance = json.loads((dst / "qkmap_conversion.json").read_text())
    assert provenance["source"] == str(src) and provenance["source_architecture"] == type(entry["model"]).__name__
    assert provenance["init"] == "exact" and provenance["omega_0"] == 1e-3 and provenance["num_frequencies"] == 1
    assert provenance["qkmap_hf_version"] == qkmap_hf.__version__ and provenance["transformers_version"]
    assert provenance["base_model"] == f"tiny-org/{kind}" and provenance["timestamp"]
    card = (dst / "README.md").read_text()
    assert f"base_model: tiny-org/{kind}" in card and "qkmap_conversion.json" in card
    assert not list(dst.parent.glob(f".{dst.name}.tmp-*")), "temporary folder left behind"


@pytest.mark.parametrize("kind", KINDS)
def test_tensors_copied_and_qk_map_initialised(converted, kind):
    entry = converted[kind]
    source = load_tensors(entry["src"])
    tensors = load_tensors(entry["dst"])
    config = qkmap_hf.QKMapConfig.from_pretrained(entry["dst"])
    initial = QKMapFeatureMap(config).initial_values()
    for name, value in source.items():  # every source tensor, bit for bit (q/k/v biases included)
        assert torch.equal(tensors[name], value), name
    layers = config.num_hidden_layers
    qk_names = {n for n in tensors if ".qk_map." in n}
    assert len(qk_names) == 3 * layers
    for layer in range(layers):
        for param in ("log_frequency", "query_gain", "key_gain"):
            value = tensors[f"model.layers.{layer}.self_attn.qk_map.{param}"]
            assert value.dtype == torch.float32 and torch.equal(value, initial[param])
    gain = tensors["model.layers.0.self_attn.qk_map.query_gain"]
    assert torch.all(gain[:, 1] == 1) and torch.all(gain[:, 0] == 0)  # a_sin = 1 (times 1/omega), a_cos = 0
    assert torch.allclose(tensors["model.layers.0.self_attn.qk_map.log_frequency"].exp(), torch.tensor(1e-3))
    extra = set(tensors) - set(source) - qk_names
    if kind == "qwen2":  # Qwen2 has no o_proj bias; the QK-MAP layout gets an exact zero one
        assert extra == {f"model.layers.{i}.self_attn.o_proj.bias" for i in range(layers)}
        assert all(torch.count_nonzero(tensors[n]) == 0 for n in extra)
    else:
        assert extra == set()


def test_sharded_source_converts_like_unsharded(converted, tmp_path):
    """The Mistral fixture is sharded; the same model saved as one file converts to identical tensors."""
    entry = converted["mistral"]
    single_src, single_dst = tmp_path / "single", tmp_path / "single-qkmap"
    entry["model"].save_pretrained(single_src)
    convert_checkpoint(single_src, single_dst, progress=False)
    sharded_files = sorted(p.name for p in entry["dst"].glob("*.safetensors"))
    assert sharded_files == sorted(p.name for p in entry["src"].glob("*.safetensors")) and len(sharded_files) > 3
    assert [p.name for p in single_dst.glob("*.safetensors")] == ["model.safetensors"]
    assert not (single_dst / "model.safetensors.index.json").exists()
    sharded, single = load_tensors(entry["dst"]), load_tensors(single_dst)
    assert sharded.keys() == single.keys()
    assert all(torch.equal(sharded[name], single[name]) for name in single)
    index = json.loads((entry["dst"] / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(sharded)
    source_map = json.loads((entry["src"] / "model.safetensors.index.json").read_text())["weight_map"]
    for name, file in index["weight_map"].items():
        if name in source_map:
            assert file == source_map[name]  # same layout
        else:  # qk_map tensors sit with their layer's attention
            assert file == source_map[name.split(".qk_map.")[0] + ".q_proj.weight"]
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in sharded.values())


@pytest.mark.slow
def test_reload_in_clean_process_without_qkmap_hf(converted, ids, tmp_path):
    folders = {kind: str(entry["dst"]) for kind, entry in converted.items()}
    result = run_clean_python(
        f"""
        import json, sys, torch
        from transformers import AutoModelForCausalLM
        ids = torch.tensor({ids.tolist()})
        out = {{}}
        for kind, folder in {folders!r}.items():
            model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()
            with torch.no_grad():
                out[kind] = {{"logits": model(ids).logits[0].tolist(), "class": type(model).__module__}}
        out["qkmap_hf_loaded"] = any(name.startswith("qkmap_hf") for name in sys.modules)
        print(json.dumps(out))
        """,
        cwd=tmp_path,
    )
    assert result.pop("qkmap_hf_loaded") is False
    for kind, entry in converted.items():
        assert result[kind]["class"].startswith("transformers_modules"), result[kind]["class"]
        with torch.no_grad():
            source_logits = entry["model"](ids).logits[0]
        kl = kl_per_token(source_logits, torch.tensor(result[kind]["logits"]))
        assert kl.max().item() <= KL_BOUND, kind


def test_convert_model_in_memory_equals_checkpoint(converted, ids):
    entry = converted["llama"]
    in_memory = convert_model(entry["model"], init="exact")
    on_disk = load_tensors(entry["dst"])
    state = in_memory.state_dict()
    assert set(state) == set(on_disk)
    assert all(torch.equal(state[name], on_disk[name]) for name in on_disk)
    # weights are copies unless share_weights=True: training the copy leaves the source alone
    assert state["model.embed_tokens.weight"].data_ptr() != entry["model"].model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        kl = kl_per_token(entry["model"](ids).logits[0], in_memory(ids).logits[0])
    assert kl.max().item() <= KL_BOUND


def test_convert_model_tied_qwen2_keeps_embeddings_tied(converted, ids):
    in_memory = convert_model(converted["qwen2"]["model"])
    assert in_memory.lm_head.weight.data_ptr() == in_memory.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        kl = kl_per_token(converted["qwen2"]["model"](ids).logits[0], in_memory(ids).logits[0])
    assert kl.max().item() <= KL_BOUND


@pytest.mark.parametrize(
    "rope",
    [
        LLAMA3_ROPE,
        {"rope_type": "linear", "factor": 2.0},
        {"rope_type": "dynamic", "factor": 2.0},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    ],
    ids=lambda r: r["rope_type"],
)
def test_rope_scaling_carried_over(rope):
    """Each rope type survives conversion; 300 tokens run past max_position_embeddings (dynamic rescales)."""
    torch.manual_seed(0)
    source = LlamaForCausalLM(
        LlamaConfig(**tiny_config_kwargs(rope_scaling=dict(rope), rope_theta=5000.0, initializer_range=0.1))
    ).eval()
    converted_model = convert_model(source)
    assert converted_model.config.rope_parameters == source.config.rope_parameters
    tokens = torch.randint(0, 256, (1, 300), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        kl = kl_per_token(source(tokens).logits[0], converted_model(tokens).logits[0])
    assert kl.max().item() <= KL_BOUND


def test_more_frequency_blocks_and_bfloat16(converted, ids):
    """F=2 exact stays exact (only the first sine block carries z); --dtype bfloat16 keeps qk_map in float32."""
    source = converted["llama"]["model"]
    model = convert_model(source, num_frequencies=2)
    assert model.config.query_key_dim == 4 * model.config.head_dim
    with torch.no_grad():
        kl = kl_per_token(source(ids).logits[0], model(ids).logits[0])
    assert kl.max().item() <= KL_BOUND
    half = convert_model(source, dtype="bfloat16")
    assert half.model.embed_tokens.weight.dtype == torch.bfloat16
    assert half.model.layers[0].self_attn.qk_map.log_frequency.dtype == torch.float32
    assert half.config.dtype in ("bfloat16", torch.bfloat16)


def test_native_init_uses_native_parametrization(converted, ids, tmp_path):
    entry = converted["llama"]
    dst = tmp_path / "native"
    convert_checkpoint(entry["src"], dst, init="native", progress=False)
    config = qkmap_hf.QKMapConfig.from_pretrained(dst)
    assert config.qkmap_init == "native" and config.qkmap_gain_parametrization == "absolute"
    tensors = load_tensors(dst)
    initial = QKMapFeatureMap(config).initial_values()
    assert torch.equal(tensors["model.layers.1.self_attn.qk_map.log_frequency"], initial["log_frequency"])
    assert torch.all(tensors["model.layers.1.self_attn.qk_map.query_gain"] == 1)
    omega = initial["log_frequency"].exp()
    assert math.isclose(omega.min().item(), 0.1, rel_tol=1e-5) and math.isclose(omega.max().item(), 3.0, rel_tol=1e-5)
    assert json.loads((dst / "qkmap_conversion.json").read_text())["init"] == "native"
    model = AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32).eval()
    with torch.no_grad():
        kl = kl_per_token(entry["model"](ids).logits[0], model(ids).logits[0])
    assert kl.mean().item() > KL_BOUND  # not function-preserving: the drift is real and measurable


@pytest.mark.slow
def test_cli_command_and_script(converted, tmp_path):
    from qkmap_hf.cli import COMMANDS
    from qkmap_hf.commands import convert as convert_command

    assert COMMANDS["convert"] == "qkmap_hf.commands.convert"
    src = converted["llama"]["src"]
    dst = tmp_path / "cli"
    argv = [str(src), str(dst), "--dtype", "bfloat16", "--num-frequencies", "2", "--omega0", "0.002", "--no-progress"]
    assert convert_command.main(argv) == 0
    config = json.loads((dst / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and config["qkmap_num_frequencies"] == 2
    assert config["qkmap_exact_frequency"] == 0.002
    with safe_open(str(dst / "model.safetensors"), framework="pt") as handle:
        assert handle.get_slice("model.layers.0.mlp.up_proj.weight").get_dtype() == "BF16"
        assert handle.get_slice("model.layers.0.self_attn.qk_map.key_gain").get_dtype() == "F32"
    # an existing DST without --overwrite: exit code 2 and a message, nothing touched
    assert convert_command.main([str(src), str(dst), "--no-progress"]) == 2
    assert json.loads((dst / "config.json").read_text())["qkmap_num_frequencies"] == 2

    script_dst = tmp_path / "script"
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "conversion" / "convert_llama_to_qkmap.py"), str(src), str(script_dst)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert load_tensors(script_dst).keys() == load_tensors(converted["llama"]["dst"]).keys()
    assert "converting" in result.stderr  # the tqdm progress bar over tensors


def test_supported_architectures_listed():
    assert set(SUPPORTED_ARCHITECTURES) == {
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
    }


def test_canonical_is_the_deprecated_name_of_the_native_init():
    from qkmap_hf.cli import build_parser
    from qkmap_hf.conversion.options import ConversionOptions

    with pytest.warns(FutureWarning, match="'canonical' is deprecated"):
        assert ConversionOptions(init="canonical").init == "native"
    assert build_parser().parse_args(["convert", "a", "b", "--init", "canonical"]).init == "canonical"
