"""The paper's three attention diagnostics for any causal LM with separate ``q_proj``/``k_proj`` modules.

Works for Llama-family checkpoints (the source of a conversion), converted and trained QK-MAP models, and the
``standard``/``qk_norm`` baselines, so their numbers sit side by side:

1. **Input-scale sensitivity.** The outputs of ``q_proj`` and ``k_proj`` of one layer (``z = W x + b``, the
   input of the query/key construction) are multiplied by a factor ``s``; the layer's attention rows are
   compared with the unscaled ones by total-variation distance, per head. The attention module is re-run on
   the inputs it saw in the unscaled pass, so each number isolates one layer. QK-Norm divides the scale out (zero up to its epsilon), standard attention
   sharpens or flattens with ``s**2``, QK-MAP moves its phases ``omega * z``. For QK-MAP layers the typical
   phase ``omega * |z|`` is reported too: while it is small the model computes standard attention (the
   regime of an exactly converted model), large phases mean the periodic features are in use.
2. **Attention mass on the first token** (the attention sink), per head, averaged over query positions >= 1.
3. **Evidence contrast** in the synthetic long-context task (``qkmap_hf.tasks.needle``): from the question
   tokens, attention per evidence token over attention per distractor token (log2; 0 means no preference),
   per head and context length (in tokens of the model's tokenizer). Token 0 is left out of the distractors
   so that the sink of analysis 2 does not dilute this one.

Attention weights come from hooks on the attention modules with the eager kernel; rows are reduced as they
are produced, so long contexts do not keep every layer's full matrix.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import attention_probes as probes
from .analysis_plots import plot_comparison, plot_model
from .attention_probes import (
    AttentionLayer,
    attention_layers,
    attention_weights,
    forward_without_cache,
    prepended_bos_id,
    use_eager_attention,
)
from .fileio import atomic_write_json
from .flags import comma_floats, comma_ints, parsed_by
from .loading import load_causal_lm
from .phases import describe, input_dim_of, phase_magnitudes, quantiles, regime_from_roles

FORMAT = "qkmap-analysis/1"


@dataclass
class AnalysisSettings:
    """What to measure; defaults take seconds for tiny models and minutes for SmolLM2-135M on a CPU.

    The analysis group: ``qkmap analyze``'s flags are these fields (``qkmap_hf.flags``), so the defaults live here
    only. ``text_file`` is ``--text`` and, once ``analyze`` ran, the record of the text it read."""

    scales: tuple[float, ...] = field(
        default=(0.5, 2.0, 4.0),
        metadata={"help": "input-scale factors, comma-separated", "action": parsed_by(comma_floats)},
    )
    max_tokens: int = field(default=256, metadata={"help": "tokens per text window"})
    num_windows: int = field(default=4, metadata={"help": "text windows, one batch"})
    context_lengths: tuple[int, ...] = field(
        default=(256, 512, 1024),
        metadata={
            "help": "long-context lengths in tokens, comma-separated",
            "aliases": ["--lengths"],
            "action": parsed_by(comma_ints),
        },
    )
    needle_examples: int = field(default=4, metadata={"help": "examples per length"})
    seed: int = field(default=0, metadata={"help": "seed of the synthetic examples"})
    text_file: str | None = field(
        default=None,
        metadata={"help": "UTF-8 text for analyses 1-2 (default: the bundled Tempest passages)", "aliases": ["--text"]},
    )

    def __post_init__(self) -> None:
        if not self.scales or any(not math.isfinite(s) or s <= 0 or s == 1.0 for s in self.scales):
            raise ValueError(f"--scales {self.scales}: must be finite positive factors other than 1.")
        for name in ("max_tokens", "num_windows", "needle_examples"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(self, name)}: must be positive.")
        if self.seed < 0:
            raise ValueError(f"--seed {self.seed}: must not be negative.")
        if self.max_tokens < 8:
            raise ValueError(f"max_tokens={self.max_tokens} is too short for attention statistics; use at least 8.")
        if any(length < 32 for length in self.context_lengths):
            raise ValueError(f"context_lengths={self.context_lengths}: each must be at least 32 tokens.")


def _scale_hook(factor: float) -> Callable:
    def hook(_module, _inputs, output):
        return output * factor

    return hook


def _contrast_hook(
    layer: AttentionLayer,
    question: torch.Tensor,
    evidence: torch.Tensor,
    distractor: torch.Tensor,
    lifts: list,
    masses: list,
) -> Callable:
    """Hook: reduce the question rows of one layer to per-head log2 lift and evidence mass, keep nothing else."""

    def hook(_module, _inputs, output):
        rows = attention_weights(output, layer)[0][:, question]  # (heads, question tokens, keys)
        e_mass = rows[..., evidence].sum(-1)
        d_mass = rows[..., distractor].sum(-1)
        lift = (e_mass / evidence.sum()) / (d_mass / distractor.sum()).clamp_min(1e-30)
        lifts[layer.index] = torch.log2(lift.clamp_min(1e-30)).mean(-1).tolist()
        masses[layer.index] = e_mass.mean(-1).tolist()

    return hook


def _phase_stats(layer: AttentionLayer, z: torch.Tensor) -> dict[str, float]:
    """``|omega * z|`` over tokens, heads, frequencies and channels (``qkmap_hf.phases``, the one definition)."""
    m = input_dim_of(layer.attention) or z.shape[-1] // layer.feature_map.frequency().shape[0]
    return quantiles(phase_magnitudes(z, layer.feature_map.frequency(), m))


def _regime(layer_phases: list[dict]) -> str:
    return describe(regime_from_roles(layer_phases))


def _windows(tokenizer, text: str, settings: AnalysisSettings) -> tuple[torch.Tensor, bool]:
    """``num_windows`` consecutive windows of ``max_tokens``; each starts with BOS when the tokenizer adds one."""
    bos = prepended_bos_id(tokenizer)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    body = settings.max_tokens - (1 if bos is not None else 0)
    count = min(settings.num_windows, len(ids) // body)
    if count == 0:
        raise ValueError(
            f"The text has {len(ids)} tokens, fewer than one window of max_tokens={settings.max_tokens}; pass a longer "
            "--text or a smaller --max-tokens."
        )
    rows = [([bos] if bos is not None else []) + ids[i * body : (i + 1) * body] for i in range(count)]
    return torch.tensor(rows), bos is not None


def _capture_all(
    model: nn.Module, layers: list[AttentionLayer], input_ids: torch.Tensor, with_phase: bool
) -> tuple[list, dict]:
    """Unscaled attention of every layer, each attention module's inputs, and the q/k projections of QK-MAP layers."""
    attentions: list[torch.Tensor | None] = [None] * len(layers)
    projections: dict[tuple[int, str], torch.Tensor] = {}
    handles = []
    for layer in layers:

        def grab(_m, _i, output, layer=layer):
            attentions[layer.index] = attention_weights(output, layer)

        def inputs(_m, args, kwargs, layer=layer):
            layer.extra["inputs"] = (args, kwargs)

        handles.append(layer.attention.register_forward_hook(grab))
        handles.append(layer.attention.register_forward_pre_hook(inputs, with_kwargs=True))
        if with_phase and layer.feature_map is not None:
            for name, proj in (("query", layer.q_proj), ("key", layer.k_proj)):

                def keep(_m, _i, output, key=(layer.index, name)):
                    projections[key] = output.detach()

                handles.append(proj.register_forward_hook(keep))
    try:
        forward_without_cache(model, input_ids)
    finally:
        for handle in handles:
            handle.remove()
    return attentions, projections


@torch.no_grad()
def scale_sensitivity(layers: list[AttentionLayer], baseline: list[torch.Tensor], scales, progress) -> dict:
    """Analysis 1: total-variation distance of attention rows under rescaled ``q_proj``/``k_proj`` outputs.

    Each attention module is called again on the inputs it received in the unscaled pass, with its projections
    scaled: earlier layers are untouched by construction, and no full forward pass is repeated.
    """
    per_head: dict[str, list[list[float]]] = {}
    for scale in scales:
        rows = []
        for layer in layers:
            args, kwargs = layer.extra["inputs"]
            handles = [
                layer.q_proj.register_forward_hook(_scale_hook(scale)),
                layer.k_proj.register_forward_hook(_scale_hook(scale)),
            ]
            try:
                weights = attention_weights(layer.attention(*args, **kwargs), layer)
            finally:
                for handle in handles:
                    handle.remove()
            # rows >= 1: the first query attends to itself only, in every mode
            tv = 0.5 * (weights - baseline[layer.index]).abs().sum(-1)[:, :, 1:]
            rows.append(tv.mean(dim=(0, 2)).tolist())
            progress(1)
        per_head[_key(scale)] = rows
    for layer in layers:
        layer.extra.pop("inputs", None)
    return {
        "metric": "mean total-variation distance of attention rows (query positions >= 1) vs. unscaled",
        "scaled": "outputs of q_proj and k_proj of one layer at a time",
        "scales": list(scales),
        "per_head": per_head,
        "layer_mean": {s: [sum(r) / len(r) for r in rows] for s, rows in per_head.items()},
        "mean": {s: _mean2(rows) for s, rows in per_head.items()},
        "max": {s: max(max(r) for r in rows) for s, rows in per_head.items()},
    }


def first_token_mass(baseline: list[torch.Tensor], first_is_bos: bool) -> dict:
    """Analysis 2: attention on position 0, per head, averaged over query positions >= 1 and windows."""
    per_head = [weights[:, :, 1:, 0].mean(dim=(0, 2)).tolist() for weights in baseline]
    length = baseline[0].shape[-1]
    return {
        "per_head": per_head,
        "layer_mean": [sum(r) / len(r) for r in per_head],
        "mean": _mean2(per_head),
        "uniform_reference": sum(1.0 / (t + 1) for t in range(1, length)) / (length - 1),
        "first_token_is_bos": first_is_bos,
        "tokens": length,
    }


def evidence_contrast(
    model, layers, tokenizer, settings: AnalysisSettings, max_positions: int | None, progress
) -> dict:
    """Analysis 3: attention per evidence token over attention per distractor token, from the question tokens.

    A prompt over the model's length loses distractors from its start (``needle_prompt_ids``): the question stays.
    """
    by_length: dict[str, dict] = {}
    skipped: list[dict] = []
    prompts_by_length = probes.needle_prompts(
        tokenizer, settings.context_lengths, settings.needle_examples, settings.seed, max_positions, skipped, progress
    )
    for length, prompts in prompts_by_length:
        lifts, masses, token_counts = [], [], []
        for ids, kinds in prompts:
            evidence = torch.tensor([k in ("evidence", "value") for k in kinds])
            distractor = torch.tensor([k == "distractor" for k in kinds])
            distractor[0] = False
            question = torch.tensor([k == "question" for k in kinds]).nonzero().flatten()
            layer_lift: list[list[float]] = [[] for _ in layers]
            layer_mass: list[list[float]] = [[] for _ in layers]
            handles = [
                layer.attention.register_forward_hook(
                    _contrast_hook(layer, question, evidence, distractor, layer_lift, layer_mass)
                )
                for layer in layers
            ]
            try:
                forward_without_cache(model, torch.tensor([ids]))
            finally:
                for handle in handles:
                    handle.remove()
            lifts.append(layer_lift)
            masses.append(layer_mass)
            token_counts.append(len(ids))
            progress(1)
        if not lifts:
            continue
        lift_mean = _average(lifts)
        mass_mean = _average(masses)
        by_length[str(length)] = {
            "tokens_mean": round(sum(token_counts) / len(token_counts)),
            "examples": len(token_counts),
            "per_head_log2_lift": lift_mean,
            "per_head_evidence_mass": mass_mean,
            "layer_mean_log2_lift": [sum(r) / len(r) for r in lift_mean],
            "mean_log2_lift": _mean2(lift_mean),
            "max_head_log2_lift": max(max(r) for r in lift_mean),
            "mean_evidence_mass": _mean2(mass_mean),
        }
    return {
        "metric": "log2(attention per evidence token / attention per distractor token), from question tokens",
        "lengths": [int(k) for k in by_length],
        "by_length": by_length,
        "skipped": skipped,
    }


def _key(scale: float) -> str:
    return f"{scale:g}"


def _mean2(rows: list[list[float]]) -> float:
    values = [v for r in rows for v in r]
    return sum(values) / len(values)


def _average(samples: list[list[list[float]]]) -> list[list[float]]:
    return torch.tensor(samples, dtype=torch.float64).mean(0).tolist()


def _default_text() -> str:
    from .tasks import data_file

    lines = data_file("shakespeare_passages.jsonl").read_text(encoding="utf-8").splitlines()
    return "\n\n".join(json.loads(line)["text"] for line in lines if line.strip())


@torch.no_grad()
def analyze_model(
    model: nn.Module,
    tokenizer,
    text: str | None = None,
    settings: AnalysisSettings | None = None,
    *,
    progress: bool = True,
    label: str = "model",
) -> dict:
    """Run the three analyses on a loaded model; returns the JSON-ready result (no files written)."""
    from tqdm.auto import tqdm

    settings = settings or AnalysisSettings()
    model.eval()
    use_eager_attention(model)
    layers = attention_layers(model)
    input_ids, first_is_bos = _windows(tokenizer, text if text is not None else _default_text(), settings)
    device = next(model.parameters()).device
    input_ids = input_ids.to(device)
    config = getattr(model, "config", None)
    total = 1 + len(layers) * (len(settings.scales) + 1) + 2 * len(settings.context_lengths) * settings.needle_examples
    bar = tqdm(total=total, desc=f"analyze {label}", disable=not progress, unit="pass")
    try:
        has_map = any(layer.feature_map is not None for layer in layers)
        baseline, projections = _capture_all(model, layers, input_ids, with_phase=has_map)
        bar.update(1)
        key_scale = probes.key_scale_sensitivity(layers, baseline, bar.update)  # before scale_sensitivity pops inputs
        result: dict[str, Any] = {
            "label": label,
            "model_class": type(model).__name__,
            "model_type": getattr(config, "model_type", None),
            "qk_mode": getattr(
                config, "qk_mode", "standard" if getattr(config, "model_type", None) == "llama" else None
            ),
            "num_layers": len(layers),
            "num_heads": baseline[0].shape[1],
            "scale_sensitivity": scale_sensitivity(layers, baseline, settings.scales, bar.update),
            "first_token_mass": first_token_mass(baseline, first_is_bos),
            "phase": None,
            **probes.pattern_measures(baseline),
            "key_scale_sensitivity": key_scale,
        }
        if has_map:
            phases = [
                {
                    "layer": layer.index,
                    "query": _phase_stats(layer, projections[(layer.index, "query")]),
                    "key": _phase_stats(layer, projections[(layer.index, "key")]),
                }
                for layer in layers
                if layer.feature_map is not None
            ]
            result["phase"] = {
                "metric": "|omega * z| over tokens, heads, frequencies, channels",
                "layers": phases,
                "regime": _regime(phases),
            }
        del baseline
        max_positions = getattr(config, "max_position_embeddings", None)
        result["evidence_contrast"] = evidence_contrast(model, layers, tokenizer, settings, max_positions, bar.update)
        result["answer_contrast"] = probes.answer_value_contrast(
            model,
            layers,
            tokenizer,
            settings.context_lengths,
            settings.needle_examples,
            settings.seed,
            max_positions,
            bar.update,
        )
    finally:
        bar.close()
    return result


# --------------------------------------------------------------------------------------------------
# loading, plots, files
# --------------------------------------------------------------------------------------------------


def load_for_analysis(
    path: str | Path, *, trust_remote_code: bool = False, dtype: torch.dtype = torch.float32, device: str = "cpu"
):
    """Model (eager attention) and tokenizer of a checkpoint folder or Hub id; QK-MAP needs no remote code."""
    from transformers import AutoTokenizer

    model = load_causal_lm(str(path), attn_implementation="eager", dtype=dtype, trust_remote_code=trust_remote_code)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as error:
        raise ValueError(
            f"{path} has no loadable tokenizer ({error}); the analysis needs one next to the weights."
        ) from error
    return model.to(device).eval(), tokenizer


def _unique_labels(paths: Sequence[str | Path]) -> list[str]:
    labels: list[str] = []
    for path in paths:
        base = Path(str(path)).name or str(path).replace("/", "_")
        base = "".join(c if c.isalnum() or c in "-_." else "_" for c in base) or "model"
        label, n = base, 2
        while label in labels:
            label, n = f"{base}_{n}", n + 1
        labels.append(label)
    return labels


def analyze(
    models: Sequence[str | Path],
    output_dir: str | Path,
    *,
    text_file: str | Path | None = None,
    settings: AnalysisSettings | None = None,
    trust_remote_code: bool = False,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    progress: bool = True,
) -> dict:
    """Analyse each checkpoint; write ``output_dir/analysis.json``, per-model PNGs and comparison PNGs.

    The first model is the subject (``qkmap card --analysis`` picks the entry whose path matches its folder);
    the rest are ``--compare`` models. Returns the JSON written.
    """
    if not models:
        raise ValueError("analyze() needs at least one model path.")
    settings = settings or AnalysisSettings()
    if text_file is not None:
        text_path = Path(text_file)
        if not text_path.is_file():
            raise FileNotFoundError(f"--text {text_path} does not exist; pass a UTF-8 text file.")
        text = text_path.read_text(encoding="utf-8", errors="replace")
        settings.text_file = str(text_path.resolve())
    else:
        text = _default_text()
        settings.text_file = "qkmap_hf/tasks/data/shakespeare_passages.jsonl (The Tempest)"
    output = Path(output_dir)
    output.mkdir(parents=True, exist_ok=True)
    results = []
    for path, label in zip(models, _unique_labels(models), strict=True):
        model, tokenizer = load_for_analysis(path, trust_remote_code=trust_remote_code, dtype=dtype, device=device)
        result = analyze_model(model, tokenizer, text, settings, progress=progress, label=label)
        del model
        local = Path(str(path))
        result["path"] = str(local.resolve()) if local.exists() else str(path)
        result["plots"] = plot_model(result, output / label, output)
        results.append(result)
    data = {
        "format": FORMAT,
        "settings": {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(settings).items()},
        "models": results,
        "comparison_plots": plot_comparison(results, output) if len(results) > 1 else {},
    }
    atomic_write_json(output / "analysis.json", data)
    return data


__all__ = [
    "AnalysisSettings",
    "analyze",
    "analyze_model",
    "attention_layers",
    "load_for_analysis",
    "plot_comparison",
    "plot_model",
]
