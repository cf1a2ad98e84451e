"""The healing recipe's pieces: least-squares gain compensation, the linear phase ramp and cos rows switched on to a
share of the feature energy, each checked against a direct computation on a tiny converted model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from qkmap_hf import phases
from qkmap_hf.assets import shakespeare_text
from qkmap_hf.training.data import build_datasets, byte_level_tokenizer
from qkmap_hf.training.heal import _load_state, _save_state
from qkmap_hf.training.schedules import (
    GainSwitchOnSchedule,
    PhaseScaleSchedule,
    Ramp,
    _sketch,
    least_squares_sine_scale,
)
from tests.utils import kl_per_token, load_float32, tiny_llama_converted_exactly

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("recipe")
    folders = tiny_llama_converted_exactly(root, initializer_range=0.2)
    text = root / "text.txt"
    text.write_text(shakespeare_text(max_chars=20_000, plays=("hamlet_gut",)), encoding="utf-8")
    train_set, _, _ = build_datasets([text], byte_level_tokenizer(), 64, eval_fraction=0.0)
    return {**folders, "blocks": train_set.blocks[:4]}


_load = load_float32


def _gains(model) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(a.qk_map.query_gain.detach().clone(), a.qk_map.key_gain.detach().clone())
            for a in phases.feature_map_layers(model)]  # fmt: skip


def test_least_squares_sine_scale_matches_a_direct_fit_on_samples():
    torch.manual_seed(0)
    scales = torch.linspace(0.5, 3.0, 8)
    z = torch.randn(20_000, 2, 8) * scales  # (tokens, kv_heads, m), scales per channel
    frequency = (1.2 / (1.645 * scales)).expand(2, 1, 8)  # p90 phase 1.2 rad, as a heal puts it
    s = torch.sin(frequency[:, 0] * z) / frequency[:, 0]
    direct = (z * s).sum(0) / (s * s).sum(0)  # argmin_c sum (c s - z)^2
    from_sketch = least_squares_sine_scale(_sketch(z.abs()), frequency)[:, 0]
    torch.testing.assert_close(from_sketch, direct, rtol=0.02, atol=0.0)
    assert (direct > 1.05).all()  # the sine bends the large |z| down: the fit scales it back up
    wrapped = torch.full((20_000, 1, 1), 3.9)  # every |z| past pi: the fit alone would switch the channel off
    assert least_squares_sine_scale(_sketch(wrapped), torch.ones(1, 1, 1)).item() == 1.0
    tiny = least_squares_sine_scale(_sketch(z.abs()), torch.full((2, 1, 8), 1e-3))
    torch.testing.assert_close(tiny, torch.ones_like(tiny), rtol=1e-5, atol=0.0)


def test_compensation_is_exact_at_the_start_and_follows_the_fit_at_the_end(folders):
    blocks = folders["blocks"]
    source_logits = _load(folders["src"])(input_ids=blocks).logits

    def forced(compensate: bool):
        model = _load(folders["conv"])
        schedule = PhaseScaleSchedule(alpha=1.5, ramp=Ramp(0.0, 0.5), space="linear", compensate_gains=compensate)
        schedule.prepare(model)
        schedule.calibrate(model, blocks, step=0)
        before = _gains(model)
        schedule.apply(model, 0.0)
        after = _gains(model)
        assert all(torch.equal(q, q2) and torch.equal(k, k2) for (q, k), (q2, k2) in zip(before, after, strict=True))
        schedule.apply(model, 1.0)
        with torch.no_grad():
            kl = kl_per_token(source_logits, model(input_ids=blocks).logits).mean().item()
        return model, schedule, before, kl

    model, schedule, before, kl_compensated = forced(True)
    for index, (attention, (query, key)) in enumerate(zip(phases.feature_map_layers(model), before, strict=True)):
        scale = schedule.sine_scale(index, attention.qk_map.log_frequency)  # (2, kv, F, m)
        torch.testing.assert_close(attention.qk_map.query_gain[:, 1::2], query[:, 1::2] * scale[0])
        torch.testing.assert_close(attention.qk_map.key_gain[:, 1::2], key[:, 1::2] * scale[1])
        assert (scale > 1.0).all()
    _, _, _, kl_plain = forced(False)
    assert kl_compensated < 0.95 * kl_plain  # the fit keeps the converted model closer to its source (0.89x here)


def test_linear_ramp_space_interpolates_the_frequency(folders):
    model = _load(folders["conv"])
    schedule = PhaseScaleSchedule(alpha=1.0, ramp=Ramp(0.0, 0.5), space="linear")
    schedule.prepare(model)
    schedule.calibrate(model, folders["blocks"], step=0)
    schedule.apply(model, 0.25)
    for index, attention in enumerate(phases.feature_map_layers(model)):
        start = schedule.start_log_frequency[index].exp()
        target = schedule.target_log_frequency(index, attention.qk_map.log_frequency.shape).exp()
        torch.testing.assert_close(attention.qk_map.frequency(), (start + target) / 2, rtol=1e-5, atol=0.0)
    with pytest.raises(ValueError, match="space 'cubic'"):
        PhaseScaleSchedule(space="cubic")


def test_cos_rows_switch_on_to_the_requested_energy_share_and_not_before(folders, tmp_path):
    model = _load(folders["conv"]).train()
    blocks = folders["blocks"]
    phase = PhaseScaleSchedule(alpha=1.2, ramp=Ramp(0.0, 0.3), compensate_gains=True)
    switch = GainSwitchOnSchedule(ramp=Ramp(0.4, 0.6), cos_share=0.2, phase=phase)
    for schedule in (phase, switch):
        schedule.prepare(model)
    phase.calibrate(model, blocks, step=0)
    phase.apply(model, 0.35)
    switch.apply(model, 0.35)
    model.zero_grad()
    model(input_ids=blocks, labels=blocks).loss.backward()
    for attention, dead in zip(phases.feature_map_layers(model), switch.dead_rows, strict=True):
        for gain in (attention.qk_map.query_gain, attention.qk_map.key_gain):
            assert gain[dead].abs().max().item() == 0.0 and gain.grad[dead].abs().max().item() == 0.0

    phase.calibrate(model, blocks, step=1)  # the phases have grown: measure |z| again, then open the window
    switch.apply(model, 0.5)
    half = [a.qk_map.key_gain[:, 0].detach().clone() for a in phases.feature_map_layers(model)]
    switch.apply(model, 0.6)
    model.eval()
    with phases.PhaseRecorder(model) as recorder, torch.no_grad():
        model(input_ids=blocks)
    shares = recorder.summary()["cos_energy_share"]
    assert shares == pytest.approx([0.2] * len(shares), abs=0.02)
    for attention, key_half in zip(phases.feature_map_layers(model), half, strict=True):
        torch.testing.assert_close(key_half, attention.qk_map.key_gain[:, 0] / 2)  # linear in the window

    # The measured targets are schedule state: a restored schedule sets the same gains.
    _save_state(tmp_path / "state.safetensors", [phase, switch], {"step": 1})
    restored_phase = PhaseScaleSchedule(alpha=1.2, ramp=Ramp(0.0, 0.3), compensate_gains=True)
    restored = GainSwitchOnSchedule(ramp=Ramp(0.4, 0.6), cos_share=0.2, phase=restored_phase)
    _load_state(tmp_path / "state.safetensors", [restored_phase, restored])
    again = _load(folders["conv"])
    restored.apply(again, 0.6)
    for a, b in zip(phases.feature_map_layers(model), phases.feature_map_layers(again), strict=True):
        torch.testing.assert_close(a.qk_map.query_gain[:, 0], b.qk_map.query_gain[:, 0])
    with pytest.raises(ValueError, match="cos_share=1.5"):
        GainSwitchOnSchedule(cos_share=1.5, phase=phase)
