"""The ablation and tuning fields: logit_scale_multiplier, qk_position_prior, qkmap_rotate_cos_blocks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from qkmap_hf import QKMapConfig, QKMapForCausalLM, qkmap_features
from qkmap_hf.attention_measures import position_only_share
from qkmap_hf.training.optim import classify_parameters
from tests.utils import tiny_config_kwargs


def build(mode: str, seed: int = 0, **overrides) -> QKMapForCausalLM:
    torch.manual_seed(seed)
    model = QKMapForCausalLM(QKMapConfig(qk_mode=mode, **tiny_config_kwargs(**overrides))).eval()
    model.config._attn_implementation = "eager"
    return model


def ids(batch: int = 2, length: int = 24, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


def attentions(model: QKMapForCausalLM, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    with torch.no_grad():
        return model(x, output_attentions=True).attentions


def test_standard_at_multiplier_one_is_llama_bit_for_bit():
    kwargs = tiny_config_kwargs()
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(**kwargs)).eval()
    llama.config._attn_implementation = "eager"
    model = QKMapForCausalLM(QKMapConfig(qk_mode="standard", logit_scale_multiplier=1.0, **kwargs)).eval()
    model.config._attn_implementation = "eager"
    model.load_state_dict(llama.state_dict(), strict=True)
    x = ids()
    with torch.no_grad():
        assert torch.equal(llama(x).logits, model(x).logits)


def test_logit_scale_multiplier_is_a_temperature_in_every_mode():
    x = ids()
    # standard: a multiplier c equals Llama with the query projection scaled by c (logits are bilinear in q, k)
    scaled = build("standard", logit_scale_multiplier=3.0)
    reference = build("standard")
    with torch.no_grad():
        reference.model.layers[0].self_attn.q_proj.weight.mul_(3.0)
        reference.model.layers[1].self_attn.q_proj.weight.mul_(3.0)
        assert torch.allclose(scaled(x).logits, reference(x).logits, atol=1e-5)
    # qk_map: the multiplier multiplies the mode's scale (None: 1/sqrt(m); an explicit qkmap_logit_scale)
    m = QKMapConfig(**tiny_config_kwargs()).resolved_qkmap_input_dim
    with torch.no_grad():
        explicit = build("qk_map", qkmap_logit_scale=2.0 / m**0.5)(x).logits
        multiplied = build("qk_map", qkmap_logit_scale=None, logit_scale_multiplier=2.0)(x).logits
    assert torch.allclose(explicit, multiplied, atol=1e-6)
    assert build("qk_map", qkmap_logit_scale=0.5, logit_scale_multiplier=4.0).model.layers[0].self_attn.scaling == 2.0
    assert build("qk_norm", logit_scale_multiplier=2.0).model.layers[0].self_attn.scaling == pytest.approx(
        2.0 * QKMapConfig(**tiny_config_kwargs()).head_dim ** -0.5
    )


@pytest.mark.parametrize("mode", ["standard", "qk_norm"])
def test_position_prior_at_zero_amplitude_is_its_base_mode(mode):
    x = ids()
    base = build(mode)
    prior = build(mode, qk_position_prior="constant")
    missing = prior.load_state_dict(base.state_dict(), strict=False).missing_keys
    assert missing and all("position_prior" in k for k in missing)
    assert prior.model.layers[0].self_attn.position_prior.query_prior.eq(1).all()  # initialised like unit gains
    with torch.no_grad():
        with_prior = prior(x).logits
        for name, param in prior.named_parameters():
            if "position_prior" in name:
                param.zero_()
        assert torch.allclose(prior(x).logits, base(x).logits, atol=1e-6)
    assert (with_prior - base(x).logits).abs().max() > 1e-3  # at unit amplitude the prior changes the model


def test_position_only_share_measured_at_init():
    x = ids(batch=4, length=48)

    def share(model: QKMapForCausalLM) -> list[float]:
        return [position_only_share(a).mean for a in attentions(model, x)]

    qk_map = share(build("qk_map"))
    no_prior = share(build("qk_map", qkmap_rotate_cos_blocks=False))
    standard = share(build("standard"))  # random zero-mean projections: no systematic position term
    standard_prior = share(build("standard", qk_position_prior="constant"))
    assert min(qk_map) > 0.9, qk_map
    assert max(abs(v) for v in no_prior) < 0.05, no_prior
    assert max(abs(v) for v in standard) < 0.05, standard
    assert min(standard_prior) > 0.9, standard_prior


def test_without_rotation_the_constant_cos_block_is_softmax_invariant():
    """With z = 0 (projections zeroed) only the cos blocks remain: rotated they are a position prior, unrotated
    they add the same constant to every logit of a query, so attention is uniform over the causal keys."""
    x = ids(batch=1, length=10)
    for rotate in (True, False):
        model = build("qk_map", qkmap_rotate_cos_blocks=rotate)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_proj.weight.zero_()
                layer.self_attn.k_proj.weight.zero_()
        weights = attentions(model, x)[0][0]  # (heads, T, T)
        uniform = torch.tril(torch.ones(10, 10)) / torch.arange(1, 11)[:, None]
        assert torch.allclose(weights, uniform.expand_as(weights), atol=1e-6) == (not rotate)


def test_qkmap_features_rotate_cos_blocks_false_leaves_cos_rows_unrotated():
    torch.manual_seed(0)
    z = torch.randn(1, 2, 5, 4)
    frequency = torch.rand(2, 2, 4) + 0.5
    gain = torch.rand(2, 4, 4) + 0.5
    angle = torch.arange(5)[:, None] * torch.tensor([1.0, 0.1])[None, :]
    angle = torch.cat((angle, angle), -1)[None]  # (1, seq, m) as Llama's tables
    cos, sin = angle.cos(), angle.sin()
    rotated = qkmap_features(z, frequency, gain, cos, sin)
    plain = qkmap_features(z, frequency, gain, cos, sin, rotate_cos_blocks=False)
    blocks = lambda t: t.view(1, 2, 5, 2, 2, 4)  # noqa: E731  (batch, heads, seq, F, cos/sin, m)
    unrotated = torch.stack([torch.cos(z * frequency[:, f, None]) * gain[:, 2 * f, None] for f in range(2)], dim=3)
    assert torch.allclose(blocks(plain)[..., 0, :], unrotated, atol=1e-6)
    assert torch.equal(blocks(plain)[..., 1, :], blocks(rotated)[..., 1, :])
    assert not torch.allclose(blocks(plain)[..., 0, :], blocks(rotated)[..., 0, :])


def test_prior_model_saves_reloads_and_caches(tmp_path):
    model = build("qk_norm", qk_position_prior="constant")
    assert model.config.query_key_dim == 2 * model.config.head_dim
    model.save_pretrained(tmp_path)
    # trust_remote_code checkpoints carry the prior's module beside modeling_qkmap.py (it imports it relatively)
    import qkmap_hf.modeling.position_prior as source

    assert (tmp_path / "position_prior.py").read_text() == Path(source.__file__).read_text()
    again = QKMapForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    x = ids(batch=1)
    with torch.no_grad():
        assert torch.equal(model(x).logits, again(x).logits)
        full = again(x).logits[:, -1]
        out = again(x[:, :-1], use_cache=True)
        step = again(x[:, -1:], cache=out.cache if hasattr(out, "cache") else out.past_key_values).logits[:, -1]
    assert torch.allclose(full, step, atol=1e-5)


def test_optimizer_group_holds_every_query_key_side_parameter():
    prior = build("standard", qk_position_prior="constant")
    groups = classify_parameters(prior)
    assert sorted(n.rsplit(".", 1)[-1] for n, _ in groups["qkmap"]) == ["key_prior"] * 2 + ["query_prior"] * 2
    qk_norm = build("qk_norm")
    assert not classify_parameters(qk_norm)["qkmap"]  # default: norm weights stay with the other norms
    names = [n for n, _ in classify_parameters(qk_norm, qk_norm_in_qk_group=True)["qkmap"]]
    assert len(names) == 4 and all(n.endswith(("q_norm.weight", "k_norm.weight")) for n in names)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"logit_scale_multiplier": 0.0}, "logit_scale_multiplier"),
        ({"qk_position_prior": "learned"}, "qk_position_prior"),
        ({"qk_mode": "qk_map", "qk_position_prior": "constant"}, "qk_position_prior"),
        ({"qkmap_rotate_cos_blocks": "no"}, "qkmap_rotate_cos_blocks"),
    ],
)
def test_invalid_ablation_fields_name_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        QKMapConfig(**{"qk_mode": "standard", **tiny_config_kwargs(), **overrides})


def test_default_logit_scale_is_auto_and_old_checkpoints_keep_theirs(tmp_path):
    """ "auto" resolves to 4/sqrt(m) and is saved as that number; a config saved with null keeps 1/sqrt(m)."""
    import json

    config = QKMapConfig(**tiny_config_kwargs())
    m = config.resolved_qkmap_input_dim
    assert config.qkmap_logit_scale == pytest.approx(4.0 / m**0.5)
    config.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["qkmap_logit_scale"] == pytest.approx(4.0 / m**0.5)
    data = json.loads((tmp_path / "config.json").read_text())
    data["qkmap_logit_scale"] = None  # as written by qkmap-hf before the "auto" default
    (tmp_path / "config.json").write_text(json.dumps(data))
    old = QKMapForCausalLM(QKMapConfig.from_pretrained(tmp_path))
    assert old.model.layers[0].self_attn.scaling == pytest.approx(m**-0.5)
