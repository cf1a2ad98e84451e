"""The training monitor's numbers on attention whose answers are known, its wiring into train and compare, the
divergence guard, and the QK-MAP gain treatments (issue 19)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from qkmap_hf.modeling.configuration_qkmap import QKMAP_GAIN_TREATMENTS, QKMapConfig
from qkmap_hf.modeling.modeling_qkmap import QKMapForCausalLM
from qkmap_hf.monitoring import (
    DivergenceGuard,
    attention_statistics,
    masked_logits,
    monitor_series,
    probe,
    qkmap_gain_bound,
)
from qkmap_hf.training.optim import classify_parameters
from tests.utils import run_clean_python, tiny_config_kwargs


def _mha_config(qk_mode: str, **overrides) -> QKMapConfig:
    # One key head per query head, so q_proj = k_proj makes every query equal to its own key.
    return QKMapConfig(qk_mode=qk_mode, **tiny_config_kwargs(num_key_value_heads=4, **overrides))


# --------------------------------------------------------------------------------------------------
# Measures on hand-built attention
# --------------------------------------------------------------------------------------------------


def test_uniform_attention_has_log_k_entropy_and_one_over_k_peak():
    batch, heads, length, width = 2, 3, 9, 8
    query = torch.zeros(batch, heads, length, width)  # every logit 0: row t spreads evenly over its t + 1 keys
    key = torch.randn(batch, 1, length, width)
    stats = attention_statistics(*masked_logits(query, key, 0.5))
    rows = range(1, length)  # row 0 has one key: left out by definition
    assert stats["max_logit"] == 0.0
    assert stats["entropy_mean"] == pytest.approx(sum(math.log(t + 1) for t in rows) / len(rows), rel=1e-6)
    assert stats["entropy_min"] == pytest.approx(stats["entropy_mean"], rel=1e-6)
    assert stats["max_probability"] == pytest.approx(sum(1 / (t + 1) for t in rows) / len(rows), rel=1e-6)


def test_max_logit_is_the_one_large_product_and_masked_future_keys_do_not_count():
    query, key = torch.zeros(1, 2, 6, 4), torch.zeros(1, 1, 6, 4)
    query[0, 1, 3, 0], key[0, 0, 1, 0] = 3.0, 5.0  # head 1, query 3 against key 1: 0.25 * 15
    key[0, 0, 5, 0] = 100.0  # a future key for query 3: masked
    stats = attention_statistics(*masked_logits(query, key, 0.25))
    assert stats["max_logit"] == pytest.approx(0.25 * 15.0)
    # Head 1 is peaked at row 3, head 0 is uniform: the mean entropy over heads exceeds the minimum.
    assert stats["entropy_min"] < stats["entropy_mean"]
    # A boolean mask that hides key 1 removes the large logit.
    visible = torch.ones(6, 6, dtype=torch.bool).tril()
    visible[:, 1] = False
    visible[1, 1] = True
    hidden = attention_statistics(*masked_logits(query, key, 0.25, visible[None, None]))
    assert hidden["max_logit"] == pytest.approx(0.0)


@pytest.mark.parametrize("qk_mode", ["standard", "qk_norm", "qk_map"])
def test_a_query_equal_to_its_key_reaches_the_logit_bound(qk_mode):
    # q_proj = k_proj: the diagonal logit is scale * ||q_t||^2, which is the bound the monitor derives (qk_map: from
    # the gains, c^2 F m; qk_norm: from the norm weights, c^2 d; standard: from the probe's largest norms).
    torch.manual_seed(0)
    model = QKMapForCausalLM(_mha_config(qk_mode, qkmap_num_frequencies=2)).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            attention = layer.self_attn
            attention.k_proj.weight.copy_(attention.q_proj.weight)
            if qk_mode == "qk_map":
                attention.qk_map.query_gain.fill_(0.7)
                attention.qk_map.key_gain.fill_(0.7)
            if qk_mode == "qk_norm":
                attention.q_norm.weight.fill_(1.3)
                attention.k_norm.weight.fill_(1.3)
    record = probe(model, torch.randint(0, 256, (2, 24)))
    for layer, attention in zip(record.layers, (x.self_attn for x in model.model.layers), strict=True):
        assert layer["max_logit"] == pytest.approx(layer["logit_bound"], rel=1e-4)
        if qk_mode == "qk_map":
            m = model.config.resolved_qkmap_input_dim
            assert layer["logit_bound"] == pytest.approx(attention.scaling * 0.7**2 * 2 * m, rel=1e-5)
        if qk_mode == "qk_norm":
            assert layer["logit_bound"] == pytest.approx(attention.scaling * 1.3**2 * model.config.head_dim, rel=1e-5)
    assert record.worst()["max_logit"] == max(layer["max_logit"] for layer in record.layers)


def test_probe_entropy_matches_eager_attention_weights_and_leaves_the_model_as_it_was():
    torch.manual_seed(0)
    model = QKMapForCausalLM(QKMapConfig(qk_mode="qk_map", **tiny_config_kwargs()))
    model.config._attn_implementation = "eager"
    model.train()
    ids = torch.randint(0, 256, (2, 20))
    record = probe(model, ids)
    assert model.training and model.config._attn_implementation == "eager"
    with torch.no_grad():
        attentions = model.eval()(input_ids=ids, output_attentions=True).attentions
    for layer, weights in zip(record.layers, attentions, strict=True):
        p = weights[:, :, 1:].double()  # rows with more than one key
        entropy = -(p * p.clamp_min(1e-300).log()).sum(-1).mean(dim=(0, 2))
        assert layer["entropy_mean"] == pytest.approx(float(entropy.mean()), abs=1e-5)
        assert layer["entropy_min"] == pytest.approx(float(entropy.min()), abs=1e-5)
        assert layer["max_probability"] == pytest.approx(float(p.amax(-1).mean(dim=(0, 2)).max()), abs=1e-5)
    with torch.no_grad():
        log_partition = model(input_ids=ids).logits.float().logsumexp(-1)
    assert record.model["log_partition_max"] == pytest.approx(float(log_partition.max()), rel=1e-5)
    assert {"frequency_min", "frequency_max", "key_phase_p90", "query_gain_norm"} <= set(record.layers[0])


def test_gain_bound_is_cauchy_schwarz_on_the_feature_norms():
    gain = torch.tensor([[[1.0, 2.0], [3.0, 0.5]]])  # one head, F=1, m=2: rows cos, sin
    # max(a_cos^2, a_sin^2) per channel: 9 and 4 -> sqrt(13) per side.
    assert float(qkmap_gain_bound(gain, gain)) == pytest.approx(13.0)


# --------------------------------------------------------------------------------------------------
# The divergence guard
# --------------------------------------------------------------------------------------------------


class _Args:
    def get_warmup_steps(self, steps):
        return 2


class _State:
    def __init__(self, step):
        self.global_step, self.max_steps = step, 100


class _Control:
    should_training_stop = False


@pytest.mark.parametrize(
    ("losses", "stopped_at"),
    [
        ([5.0, 4.0, 3.0, 2.0, 2.5], None),  # learning
        ([5.0, 4.0, float("nan")], 3),  # non-finite
        ([5.0, 5.5, 5.6, 5.2, 5.3, 5.4], 5),  # above L0 for three logs after the warm-up (steps 3-5)
        ([5.0, 6.0, 4.0, 5.5, 3.0, 5.1, 2.0], None),  # spikes that recover
    ],
)
def test_divergence_guard(losses, stopped_at):
    guard, control = DivergenceGuard(patience=3), _Control()
    for step, loss in enumerate(losses, start=1):
        guard.on_log(_Args(), _State(step), control, logs={"loss": loss})
        if control.should_training_stop:
            break
    assert (guard.diverged or {}).get("step") == stopped_at
    assert control.should_training_stop == (stopped_at is not None)
    if stopped_at:
        assert guard.diverged["initial_loss"] == 5.0


def test_divergence_guard_judges_held_out_loss_when_the_run_evaluates_from_the_start():
    """Up-training a pretrained model with batch 1: single-batch losses above the held-out L0 are noise, not a
    divergence; held-out evaluations above L0 twice in a row after the warm-up are; a NaN training loss always is."""
    logs = [(0, {"eval_loss": 4.0})]  # L0: the held-out loss before the first step
    logs += [(step, {"loss": 4.0 + (0.6 if step % 2 else -0.3)}) for step in range(1, 40)]  # noisy, above L0 often
    logs += [(20, {"eval_loss": 3.9}), (40, {"eval_loss": 3.8})]
    guard, control = DivergenceGuard(patience=3), _Control()
    for step, entry in sorted(logs, key=lambda item: item[0]):
        guard.on_log(_Args(), _State(step), control, logs=entry)
    assert guard.diverged is None and not control.should_training_stop

    guard, control = DivergenceGuard(), _Control()
    for step, entry in [
        (0, {"eval_loss": 4.0}),
        (10, {"eval_loss": 4.2}),
        (15, {"loss": 3.0}),
        (20, {"eval_loss": 4.1}),
    ]:
        guard.on_log(_Args(), _State(step), control, logs=entry)
    assert guard.diverged == {"reason": guard.diverged["reason"], "step": 20, "initial_loss": 4.0}
    assert "held-out loss above L0=4.0000 for 2 logs" in guard.diverged["reason"]

    guard, control = DivergenceGuard(), _Control()
    for step, entry in [(0, {"eval_loss": 4.0}), (5, {"loss": float("inf")})]:
        guard.on_log(_Args(), _State(step), control, logs=entry)
    assert guard.diverged["step"] == 5 and control.should_training_stop


# --------------------------------------------------------------------------------------------------
# Gain treatments
# --------------------------------------------------------------------------------------------------


def test_gain_treatments_start_as_the_default_and_train_as_documented():
    ids = torch.randint(0, 256, (2, 16))
    logits = {}
    for treatment in QKMAP_GAIN_TREATMENTS:
        torch.manual_seed(0)
        model = QKMapForCausalLM(QKMapConfig(qkmap_gain_treatment=treatment, **tiny_config_kwargs())).eval()
        logits[treatment] = model(input_ids=ids).logits
        groups = {n: g for g, members in classify_parameters(model).items() for n, _ in members}
        gain = "model.layers.0.self_attn.qk_map.key_gain"
        expected = {"learned": "qkmap", "frozen": None, "decayed": "decay", "normalized": "qkmap"}[treatment]
        assert groups.get(gain) == expected
    for treatment in QKMAP_GAIN_TREATMENTS:
        assert torch.equal(logits[treatment], logits["learned"]), treatment


def test_normalized_gains_hold_the_bound_whatever_the_stored_gains():
    model = QKMapForCausalLM(QKMapConfig(qkmap_gain_treatment="normalized", **tiny_config_kwargs()))
    feature_map = model.model.layers[0].self_attn.qk_map
    with torch.no_grad():
        feature_map.query_gain.mul_(torch.rand_like(feature_map.query_gain) * 50)
        feature_map.key_gain.mul_(torch.rand_like(feature_map.key_gain) * 50)
    frequency = feature_map.frequency()
    bound = qkmap_gain_bound(
        feature_map.effective_gain(feature_map.query_gain, frequency),
        feature_map.effective_gain(feature_map.key_gain, frequency),
    )
    m, num_freq = model.config.resolved_qkmap_input_dim, model.config.qkmap_num_frequencies
    assert float(bound.max()) <= 2 * num_freq * m * (1 + 1e-5)
    with pytest.raises(ValueError, match="qkmap_gain_treatment='normalized' needs qkmap_init='native'"):
        QKMapConfig(qkmap_gain_treatment="normalized", qkmap_init="exact", **tiny_config_kwargs())
    with pytest.raises(ValueError, match="qkmap_gain_treatment='clipped' is invalid"):
        QKMapConfig(qkmap_gain_treatment="clipped", **tiny_config_kwargs())


@pytest.mark.slow
def test_new_options_round_trip_through_a_clean_interpreter(tmp_path):
    # The gain treatments (issue 19) and the constant-cos control (issue 24) load without qkmap_hf, same logits.
    options = {t: {"qkmap_gain_treatment": t} for t in QKMAP_GAIN_TREATMENTS[1:]}
    options["constant_cos"] = {"qkmap_cos_block": "constant"}
    ids = torch.randint(0, 256, (1, 12))
    expected = {}
    for name, fields in options.items():
        torch.manual_seed(0)
        model = QKMapForCausalLM(QKMapConfig(**fields, **tiny_config_kwargs())).eval()
        with torch.no_grad():
            model.model.layers[0].self_attn.qk_map.key_gain.mul_(1.5)  # off the initial values
            expected[name] = model(input_ids=ids).logits[0, -1].tolist()
        model.save_pretrained(tmp_path / name)
    code = f"""
import json, torch
from transformers import AutoModelForCausalLM
ids = torch.tensor({ids.tolist()})
out = {{}}
for name in {list(expected)}:
    model = AutoModelForCausalLM.from_pretrained(name, trust_remote_code=True, dtype=torch.float32).eval()
    gain = model.model.layers[0].self_attn.qk_map.key_gain
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, -1].tolist()
    config = model.config
    out[name] = dict(fields=[config.qkmap_gain_treatment, config.qkmap_cos_block], trainable=gain.requires_grad,
                     logits=logits)
print(json.dumps(out))
"""
    loaded = run_clean_python(code, cwd=tmp_path)
    for name, values in expected.items():
        config = QKMapConfig(**options[name], **tiny_config_kwargs())
        assert loaded[name]["fields"] == [config.qkmap_gain_treatment, config.qkmap_cos_block]
        assert loaded[name]["trainable"] == (name != "frozen")
        assert loaded[name]["logits"] == pytest.approx(values, abs=1e-5)


# --------------------------------------------------------------------------------------------------
# Wiring: train, flags, compare
# --------------------------------------------------------------------------------------------------


def _monitor_steps(record: dict) -> list[int]:
    return [step for step, _ in monitor_series(record["log_history"]).get("max_logit", [])]


def test_monitor_is_on_by_default_logs_through_the_trainer_and_plots(tmp_path, one_thread):
    from qkmap_hf.training.trainer import MONITOR_PLOT, PROVENANCE_FILE, TrainOptions, train

    corpus = tmp_path / "text.txt"
    corpus.write_text("To be, or not to be, that is the question.\n" * 400)
    common = dict(model="tiny", data=[str(corpus)], max_steps=5, logging_steps=1, save_steps=0, disable_tqdm=True)
    result = train(TrainOptions(output_dir=str(tmp_path / "on"), monitor_steps=2, **common))
    record = json.loads((tmp_path / "on" / PROVENANCE_FILE).read_text())
    assert _monitor_steps(record) == [1, 2, 4, 5]  # first, every 2, last
    assert (tmp_path / "on" / MONITOR_PLOT).exists()
    assert any("monitor/layer1/entropy_mean" in entry for entry in result.log_history)
    train(TrainOptions(output_dir=str(tmp_path / "off"), monitor_steps=0, **common))
    assert _monitor_steps(json.loads((tmp_path / "off" / PROVENANCE_FILE).read_text())) == []
    assert not (tmp_path / "off" / MONITOR_PLOT).exists()


def test_monitor_steps_flag_parses_and_refuses_negative():
    from qkmap_hf.cli import build_parser
    from qkmap_hf.flags import options_from_namespace
    from qkmap_hf.training.compare import CompareOptions
    from qkmap_hf.training.guards import check_train_options
    from qkmap_hf.training.options import TrainOptions

    def parse(command, cls, *extra):
        return options_from_namespace(
            cls, build_parser().parse_args([command, "--data", "d", "--output-dir", "o", *extra])
        )

    assert parse("train", TrainOptions, "--model", "tiny", "--monitor-steps", "0").monitor_steps == 0
    assert parse("train", TrainOptions, "--model", "tiny").monitor_steps == 50
    assert parse("compare", CompareOptions, "--monitor-steps", "7").monitor_steps == 7
    options = parse("train", TrainOptions, "--model", "tiny", "--monitor-steps", "-1")
    with pytest.raises(ValueError, match="--monitor-steps -1"):
        check_train_options(options)
