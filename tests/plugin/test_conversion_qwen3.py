"""Qwen3 (per-head QK-Norm) converts exactly with ``qkmap_input_norm``; the norm's power anneals to 0 and folds away.

A tiny random Qwen3ForCausalLM with GQA, ``head_dim`` unlike ``hidden/heads``, biases and norm weights far
from one is saved with transformers, converted, and compared on real numbers: per-token KL, greedy tokens,
a fresh interpreter without qkmap_hf.
"""

from __future__ import annotations

import json
import pickle

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

from qkmap_hf.conversion import ConversionError, convert_model
from qkmap_hf.modeling.modeling_qkmap import QKMapForCausalLM, QKMapInputRMSNorm
from qkmap_hf.packaging import convert_checkpoint
from qkmap_hf.surgery import calibrate_reference_scale, fold_input_norm, set_input_norm_power
from tests.utils import kl_per_token, run_clean_python, tiny_config_kwargs

KL_BOUND = 1e-6
HEAD_DIM = 24  # not hidden_size / heads = 16: Qwen3's head width is its own field


def tiny_qwen3(**overrides) -> Qwen3ForCausalLM:
    torch.manual_seed(4)
    config = Qwen3Config(
        **tiny_config_kwargs(head_dim=HEAD_DIM, attention_bias=True, initializer_range=0.1, **overrides)
    )
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                param.uniform_(0.3, 2.5)  # far from the all-ones init: the weights must travel
            elif name.endswith(".bias"):
                param.normal_(std=0.3)
    return model


def greedy(model, prompt: torch.Tensor, tokens: int = 48) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(prompt, do_sample=False, max_new_tokens=tokens, min_new_tokens=tokens, pad_token_id=0)


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    return torch.randint(0, 256, (1, 80), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("qwen3")
    model = tiny_qwen3()
    src, dst = root / "src", root / "qkmap"
    model.save_pretrained(src)
    convert_checkpoint(src, dst, progress=False)
    return {"model": model, "src": src, "dst": dst}


def test_exact_conversion_keeps_the_norm_and_the_function(qwen3, ids):
    config = json.loads((qwen3["dst"] / "config.json").read_text())
    assert config["qkmap_input_norm"] is True and config["qkmap_input_norm_power"] == 1.0
    assert config["head_dim"] == HEAD_DIM and config["qkmap_input_dim"] == HEAD_DIM
    assert config["num_key_value_heads"] == 2 and config["attention_bias"] is True
    model = AutoModelForCausalLM.from_pretrained(qwen3["dst"], dtype=torch.float32).eval()
    attention = model.model.layers[1].self_attn
    source_attention = qwen3["model"].model.layers[1].self_attn
    assert torch.equal(attention.q_norm.weight, source_attention.q_norm.weight)
    assert torch.equal(attention.k_norm.weight, source_attention.k_norm.weight)
    assert attention.q_norm.reference_scale.shape == (4,) and attention.k_norm.reference_scale.shape == (2,)
    with torch.no_grad():
        source_logits = qwen3["model"](ids).logits[0]
        converted_logits = model(ids).logits[0]
    kl = kl_per_token(source_logits, converted_logits)
    assert kl.max().item() <= KL_BOUND, f"max KL {kl.max().item():.3e}"
    assert source_logits.softmax(-1).max(-1).values.mean() > 4 / 256  # peaked: greedy equality means something
    assert torch.equal(greedy(qwen3["model"], ids[:, :12]), greedy(model, ids[:, :12]))
    # without the norm the same weights compute something else: the option is what makes it exact
    config_without = model.config.__class__.from_dict({**model.config.to_dict(), "qkmap_input_norm": False})
    plain = QKMapForCausalLM(config_without).eval()
    plain.load_state_dict(model.state_dict(), strict=False)
    with torch.no_grad():
        assert kl_per_token(source_logits, plain(ids).logits[0]).mean().item() > 1e-3


@pytest.mark.slow
def test_converted_qwen3_loads_in_a_clean_interpreter(qwen3, ids, tmp_path):
    result = run_clean_python(
        f"""
        import json, sys, torch
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(qwen3["dst"])!r}, trust_remote_code=True,
                                                     dtype=torch.float32).eval()
        with torch.no_grad():
            logits = model(torch.tensor({ids.tolist()})).logits[0]
        print(json.dumps({{"logits": logits.tolist(), "module": type(model).__module__,
                          "qkmap_hf_loaded": any(n.startswith("qkmap_hf") for n in sys.modules)}}))
        """,
        cwd=tmp_path,
    )
    assert result["qkmap_hf_loaded"] is False and result["module"].startswith("transformers_modules")
    with torch.no_grad():
        kl = kl_per_token(qwen3["model"](ids).logits[0], torch.tensor(result["logits"]))
    assert kl.max().item() <= KL_BOUND


def test_input_norm_power_against_the_written_out_formula():
    """beta = 1 is transformers' Qwen3RMSNorm bit for bit; other powers follow z / (rms^beta r^(1-beta)) * w."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    source = tiny_qwen3()
    model = convert_model(source)
    norm = model.model.layers[0].self_attn.q_norm
    assert isinstance(norm, QKMapInputRMSNorm)
    reference = Qwen3RMSNorm(HEAD_DIM, eps=source.config.rms_norm_eps)
    reference.load_state_dict({"weight": norm.weight.detach().clone()})
    z = torch.randn(2, 5, 4, HEAD_DIM, dtype=torch.float64).float() * 3
    with torch.no_grad():
        norm.reference_scale.copy_(torch.tensor([0.5, 1.0, 2.0, 4.0]))
        assert torch.equal(norm(z), reference(z))
        for power in (0.0, 0.3, 0.75):
            set_input_norm_power(model, power)
            rms = (z.double().pow(2).mean(-1, keepdim=True) + norm.variance_epsilon).sqrt()
            r = norm.reference_scale.double().view(4, 1)
            expected = norm.weight.double() * z.double() / (rms**power * r ** (1 - power))
            assert torch.allclose(norm(z).double(), expected, rtol=1e-5, atol=1e-6), power
    with pytest.raises(ValueError, match="in \\[0, 1\\]"):
        set_input_norm_power(model, 1.5)


def test_annealed_norm_at_zero_folds_into_plain_qk_map(tmp_path, ids):
    """beta = 1 with calibrated r equals the conversion; beta = 0 folds into q/k_proj: the saved config has no norm."""
    source = tiny_qwen3()
    converted = convert_model(source)
    with torch.no_grad():
        converted_logits = converted(ids).logits[0]
    model = convert_model(source)
    calibrate_reference_scale(model, [ids[:, :40], ids[:, 40:]])
    scales = model.model.layers[0].self_attn.q_norm.reference_scale
    assert not torch.allclose(scales, torch.ones_like(scales))  # calibrated: the heads' own rms(z)
    with torch.no_grad():
        assert torch.equal(model(ids).logits[0], converted_logits)  # r is unused at beta = 1
        set_input_norm_power(model, 0.0)
        annealed_logits = model(ids).logits[0]
    assert kl_per_token(converted_logits, annealed_logits).mean().item() > 1e-4  # the norm is really gone
    with pytest.raises(ConversionError, match="power"):
        fold_input_norm(convert_model(source))  # at beta = 1 folding would not be exact
    fold_input_norm(model)
    assert not model.config.qkmap_input_norm
    assert not any(isinstance(m, QKMapInputRMSNorm) for m in model.modules())
    with torch.no_grad():
        folded_logits = model(ids).logits[0]
    assert kl_per_token(annealed_logits, folded_logits).max().item() <= KL_BOUND
    model.save_pretrained(tmp_path / "healed")
    saved = json.loads((tmp_path / "healed" / "config.json").read_text())
    assert saved["qkmap_input_norm"] is False and saved["qk_mode"] == "qk_map"
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "healed", dtype=torch.float32).eval()
    assert not any(".q_norm." in name or ".k_norm." in name for name in reloaded.state_dict())
    with torch.no_grad():
        assert torch.allclose(reloaded(ids).logits[0], folded_logits, atol=1e-5)


def test_sliding_window_qwen3_refused(tmp_path):
    src = tmp_path / "src"
    tiny_qwen3(use_sliding_window=True, sliding_window=32, max_window_layers=1).save_pretrained(src)
    with pytest.raises(ConversionError) as info:
        convert_checkpoint(src, tmp_path / "dst", progress=False)
    assert "Qwen3ForCausalLM" in str(info.value) and "sliding_window=32" in str(info.value)
    assert "layers [1]" in str(info.value) and not (tmp_path / "dst").exists()


def test_pickle_only_qwen3_refused_without_unpickling(tmp_path, monkeypatch):
    src = tmp_path / "src"
    src.mkdir()
    model = tiny_qwen3()
    model.config.save_pretrained(src)
    torch.save(model.state_dict(), src / "pytorch_model.bin")

    def forbidden(*args, **kwargs):
        raise AssertionError("conversion tried to unpickle")

    monkeypatch.setattr(torch, "load", forbidden)
    monkeypatch.setattr(pickle, "load", forbidden)
    with pytest.raises(ConversionError) as info:
        convert_checkpoint(src, tmp_path / "dst", progress=False)
    assert "pytorch_model.bin" in str(info.value) and "pickle" in str(info.value)
    assert not (tmp_path / "dst").exists()


def test_qk_norm_model_saves_as_genuine_qwen3_and_converts_back(tmp_path, ids):
    """A qk_norm-mode model is Qwen3: it saves as Qwen3ForCausalLM (no qkmap code) and converts back exactly."""
    from qkmap_hf import QKMapConfig
    from qkmap_hf.surgery import save_qk_norm_as_qwen3

    torch.manual_seed(5)
    config = QKMapConfig(**tiny_config_kwargs(qk_mode="qk_norm", head_dim=HEAD_DIM, initializer_range=0.1))
    trained = QKMapForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in trained.named_parameters():
            if "_norm." in name:
                param.uniform_(0.3, 2.5)
    save_qk_norm_as_qwen3(trained, tmp_path / "qwen3")
    saved = json.loads((tmp_path / "qwen3" / "config.json").read_text())
    assert saved["model_type"] == "qwen3" and saved["architectures"] == ["Qwen3ForCausalLM"]
    assert "auto_map" not in saved and not list((tmp_path / "qwen3").glob("*.py"))
    qwen3 = AutoModelForCausalLM.from_pretrained(tmp_path / "qwen3", dtype=torch.float32).eval()
    assert type(qwen3) is Qwen3ForCausalLM
    with torch.no_grad():
        reference = trained(ids).logits[0]
        assert torch.equal(qwen3(ids).logits[0], reference)
    convert_checkpoint(tmp_path / "qwen3", tmp_path / "qkmap", progress=False)
    converted = AutoModelForCausalLM.from_pretrained(tmp_path / "qkmap", dtype=torch.float32).eval()
    with torch.no_grad():
        assert kl_per_token(reference, converted(ids).logits[0]).max().item() <= KL_BOUND


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        ({"qk_mode": "qk_norm", "qkmap_input_norm": True}, "qkmap_input_norm=True needs qk_mode='qk_map'"),
        ({"qkmap_input_norm": True, "qkmap_input_norm_power": 1.5}, "qkmap_input_norm_power=1.5"),
        ({"qkmap_input_norm": True, "qkmap_input_norm_power": -0.1}, "in [0, 1]"),
        ({"qkmap_input_norm": "yes"}, "qkmap_input_norm='yes'"),
    ],
)
def test_input_norm_fields_are_validated(fields, fragment):
    from qkmap_hf import QKMapConfig

    with pytest.raises(ValueError) as info:
        QKMapConfig(**tiny_config_kwargs(**fields))
    assert fragment in str(info.value)
