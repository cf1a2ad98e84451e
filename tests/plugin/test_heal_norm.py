"""Healing a converted QK-Norm (Qwen3) model's norm away: beta 1 -> 0, r calibrated per head, folded at the save."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import Qwen3Config, Qwen3ForCausalLM, TrainerCallback

import qkmap_hf
from qkmap_hf.assets import shakespeare_text
from qkmap_hf.training.data import build_datasets, byte_level_tokenizer
from qkmap_hf.training.heal import HealOptions, heal
from qkmap_hf.training.options import TrainOptions
from qkmap_hf.training.schedules import NormAnnealSchedule, Ramp, channel_p90
from tests.utils import load_float32, tiny_config_kwargs

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """A tiny random Qwen3 (GQA, norm weights far from one) with a byte-level tokenizer, converted exactly."""
    root = tmp_path_factory.mktemp("heal_norm")
    tokenizer = byte_level_tokenizer()
    torch.manual_seed(1)
    config = Qwen3Config(**tiny_config_kwargs(vocab_size=len(tokenizer), head_dim=24, initializer_range=0.1))
    source = Qwen3ForCausalLM(config)
    with torch.no_grad():
        for name, param in source.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                param.uniform_(0.3, 2.5)
    source.save_pretrained(root / "src")
    tokenizer.save_pretrained(root / "src")
    qkmap_hf.convert_checkpoint(root / "src", root / "conv", init="exact", progress=False)
    (root / "text.txt").write_text(shakespeare_text(max_chars=30_000, plays=("hamlet_gut",)), encoding="utf-8")
    return {"src": root / "src", "conv": root / "conv", "text": root / "text.txt"}


_load = load_float32


def _blocks(folders, count: int = 4) -> torch.Tensor:
    train_set, _, _ = build_datasets([folders["text"]], byte_level_tokenizer(), 64, eval_fraction=0.0)
    return train_set.blocks[:count]


def test_norm_schedule_is_exact_at_start_reaches_zero_and_calibrates_r(folders):
    model, blocks = _load(folders["conv"]), _blocks(folders)
    with torch.no_grad():
        converted = model(input_ids=blocks).logits
    schedule = NormAnnealSchedule(Ramp(0.0, 0.8))
    schedule.prepare(model)
    assert schedule.due(0)
    schedule.calibrate(model, blocks, step=0)
    assert not schedule.due(1)

    # r is each head's mean rms(z) at the norm's input, measured here independently.
    attention = model.model.layers[0].self_attn
    captured = []
    hook = attention.q_proj.register_forward_hook(lambda _m, _i, out: captured.append(out))
    with torch.no_grad():
        model(input_ids=blocks)
    hook.remove()
    z = captured[0].view(*blocks.shape, -1, attention.config.resolved_qkmap_input_dim)
    expected = (z.pow(2).mean(-1) + attention.q_norm.variance_epsilon).sqrt().mean(dim=(0, 1))
    torch.testing.assert_close(attention.q_norm.reference_scale.data, expected, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(expected, torch.ones_like(expected), atol=0.05)

    schedule.apply(model, 0.0)
    assert model.config.qkmap_input_norm_power == 1.0
    with torch.no_grad():
        assert torch.equal(model(input_ids=blocks).logits, converted)
    schedule.apply(model, 0.4)
    assert model.config.qkmap_input_norm_power == pytest.approx(0.5)
    with torch.no_grad():
        assert (model(input_ids=blocks).logits - converted).abs().max() > 1e-3  # the norm really moves
    for progress in (0.8, 1.0):
        schedule.apply(model, progress)
        assert model.config.qkmap_input_norm_power == 0.0

    # Resume: a fresh schedule with the saved state restores r on a fresh model.
    fresh, restored = _load(folders["conv"]), NormAnnealSchedule()
    restored.load_state_dict(schedule.state_dict())
    restored.prepare(fresh)
    assert torch.allclose(fresh.model.layers[0].self_attn.q_norm.reference_scale.data, expected, rtol=1e-5)


class _LogitsBeforeFold(TrainerCallback):
    """Keeps the healed model's logits at the end of training, before heal folds the norm."""

    def __init__(self, ids: torch.Tensor):
        self.ids, self.logits, self.had_norm = ids, None, None

    def on_train_end(self, args, state, control, model=None, **kwargs):
        self.had_norm = hasattr(model.model.layers[0].self_attn, "q_norm")
        self.power = model.config.qkmap_input_norm_power
        with torch.no_grad():
            self.logits = model.eval()(input_ids=self.ids.to(model.device)).logits.cpu()


def test_heal_anneals_the_norm_and_saves_plain_qk_map_with_the_same_function(folders, tmp_path):
    ids = _blocks(folders, 2)
    probe = _LogitsBeforeFold(ids)
    options = TrainOptions(model=str(folders["conv"]), data=[str(folders["text"])], output_dir=str(tmp_path / "out"),
                           block_size=64, batch_size=4, max_steps=10, learning_rate=1e-3, eval_steps=5, save_steps=10,
                           max_eval_blocks=8, logging_steps=1)  # fmt: skip
    heal(options, HealOptions(teacher=str(folders["src"]), norm_ramp=(0.0, 0.6)), callbacks=[probe])
    rows = json.loads((tmp_path / "out" / "heal.json").read_text())["evaluations"]
    assert [row["step"] for row in rows] == [0, 5, 10]
    assert rows[0]["norm_power"] == 1.0 and rows[0]["kl_to_teacher"] <= 1e-6
    # The step-5 evaluation sees the power set at the start of step 5 (progress 4/10 of a 0:0.6 ramp).
    assert rows[1]["norm_power"] == pytest.approx(1 - 0.4 / 0.6) and rows[2]["norm_power"] == 0.0

    assert probe.had_norm and probe.power == 0.0
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["qkmap_input_norm"] is False
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as handle:
        assert not [key for key in handle.keys() if "_norm." in key and "self_attn" in key]  # noqa: SIM118
    saved = _load(tmp_path / "out")
    assert not hasattr(saved.model.layers[0].self_attn, "q_norm")
    with torch.no_grad():
        logits = saved(input_ids=ids).logits
    torch.testing.assert_close(logits, probe.logits, rtol=1e-4, atol=1e-4)
    assert (probe.logits - _load(folders["conv"])(input_ids=ids).logits).abs().max() > 1e-2  # it did train


def test_phase_calibration_measures_the_norm_output_the_feature_map_sees(folders):
    """On a converted QK-Norm model ``p90 |z|`` is taken after the input norm, not from ``q_proj``/``k_proj``."""
    model, blocks = _load(folders["conv"]), _blocks(folders, 2)
    attention = model.model.layers[0].self_attn
    captured = []
    hooks = [getattr(attention, n).register_forward_hook(lambda _m, _i, out: captured.append(out)) for n in
             ("q_norm", "k_norm")]  # fmt: skip
    with torch.no_grad():
        model(input_ids=blocks)
    for hook in hooks:
        hook.remove()
    kv_heads = model.config.num_key_value_heads
    # (batch, seq, heads, m) -> every (token, head of the group) of each key head: (samples, kv_heads, m)
    groups = [z.reshape(-1, kv_heads, z.shape[-2] // kv_heads, z.shape[-1]).transpose(1, 2) for z in captured]
    values = torch.cat([z.reshape(-1, kv_heads, z.shape[-1]) for z in groups]).abs()
    expected = torch.quantile(values, 0.9, dim=0)
    torch.testing.assert_close(channel_p90(model, blocks)[0], expected, rtol=1e-5, atol=1e-6)
