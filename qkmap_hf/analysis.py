"""``qkmap analyze``: runs the attention diagnostics (``qkmap_hf.diagnostics``) on checkpoints and writes the report.

Works for any causal LM with separate ``q_proj``/``k_proj`` modules: Llama-family checkpoints (the source of a
conversion), converted and trained QK-MAP models, and the ``standard``/``qk_norm`` baselines, so their numbers sit
side by side. Each measure is a unit of ``qkmap_hf.diagnostics`` with its typed result; this module owns what they
share: the probe inputs (text windows, needle prompts), one unscaled pass captured for the measures that re-run a
single layer (with the phase recorder on), the order of the entries of ``analysis.json`` and its plots:

1. input-scale sensitivity (``diagnostics.scale_sensitivity``), with the phases of QK-MAP layers
   (``diagnostics.phases``, through ``phases.PhaseRecorder`` as ``qkmap verify`` measures them);
2. attention mass on the first token (``diagnostics.first_token_mass``), attention distance and the position-only
   share (``diagnostics.attention_distance``, ``diagnostics.position_share``), key-scale sensitivity
   (``diagnostics.key_scale``);
3. the needle contrasts (``diagnostics.contrast``): question to evidence, answer position to the value.
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

from .analysis_plots import plot_comparison, plot_model
from .attention_probes import needle_prompts
from .diagnostics import ModelDiagnostics, attention_distance, contrast, key_scale, position_share, scale_sensitivity
from .diagnostics import first_token_mass as first_token
from .diagnostics import phases as phase_measure
from .diagnostics.hooks import (
    AttentionLayer,
    attention_layers,
    capture,
    forward_without_cache,
    prepended_bos_id,
    use_eager_attention,
)
from .fileio import atomic_write_json
from .flags import comma_floats, comma_ints, parsed_by
from .loading import load_causal_lm

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


def first_token_mass(baseline: list[torch.Tensor], first_is_bos: bool) -> dict:
    """Analysis 2 on per-layer attention weights, as ``analysis.json`` holds it (``diagnostics.first_token_mass``)."""
    return first_token.from_weights(baseline, first_is_bos).to_dict()


def evidence_contrast(
    model: nn.Module,
    layers: list[AttentionLayer],
    tokenizer,
    settings: AnalysisSettings,
    max_positions: int | None,
    progress: Callable[[int], Any],
    kind: contrast.ContrastKind = contrast.EVIDENCE,
) -> dict:
    """Analysis 3 (or, with ``kind=contrast.ANSWER``, the answer contrast) over the needle prompts of ``settings``.

    A prompt over the model's length loses distractors from its start (``needle_prompt_ids``): the question stays.
    """
    return _contrast(model, layers, tokenizer, settings, max_positions, progress, kind).to_dict()


def _contrast(model, layers, tokenizer, settings, max_positions, progress, kind) -> contrast.NeedleContrast:
    skipped: list[dict] = []
    prompts = needle_prompts(
        tokenizer, settings.context_lengths, settings.needle_examples, settings.seed, max_positions, skipped, progress
    )
    return contrast.measure(model, layers, prompts, kind, progress, skipped)


def _default_text() -> str:
    from .tasks import data_file

    lines = data_file("shakespeare_passages.jsonl").read_text(encoding="utf-8").splitlines()
    return "\n\n".join(json.loads(line)["text"] for line in lines if line.strip())


@torch.no_grad()
def diagnose_model(
    model: nn.Module,
    tokenizer,
    text: str | None = None,
    settings: AnalysisSettings | None = None,
    *,
    progress: bool = True,
    label: str = "model",
) -> ModelDiagnostics:
    """Run every diagnostic on a loaded model; returns the typed results (no files written)."""
    from tqdm.auto import tqdm

    settings = settings or AnalysisSettings()
    model.eval()
    use_eager_attention(model)
    layers = attention_layers(model)
    input_ids, first_is_bos = _windows(tokenizer, text if text is not None else _default_text(), settings)
    input_ids = input_ids.to(next(model.parameters()).device)
    config = getattr(model, "config", None)
    total = 1 + len(layers) * (len(settings.scales) + 1) + 2 * len(settings.context_lengths) * settings.needle_examples
    bar = tqdm(total=total, desc=f"analyze {label}", disable=not progress, unit="pass")
    try:
        with phase_measure.recorder(model) as phases:
            captured = capture(model, layers, input_ids, first_is_bos)
        bar.update(1)
        model_type = getattr(config, "model_type", None)
        result = ModelDiagnostics(
            label=label,
            model_class=type(model).__name__,
            model_type=model_type,
            qk_mode=getattr(config, "qk_mode", "standard" if model_type == "llama" else None),
            num_layers=len(layers),
            num_heads=captured.weights[0].shape[1],
            key_scale_sensitivity=key_scale.measure(captured, bar.update),
            scale_sensitivity=scale_sensitivity.measure(captured, settings.scales, bar.update),
            first_token_mass=first_token.measure(captured),
            phase=phase_measure.from_recorder(phases),
            attention_distance=attention_distance.measure(captured),
            position_only_share=position_share.measure(captured),
        )
        del captured
        max_positions = getattr(config, "max_position_embeddings", None)
        for kind in (contrast.EVIDENCE, contrast.ANSWER):
            measured = _contrast(model, layers, tokenizer, settings, max_positions, bar.update, kind)
            setattr(result, kind.key, measured)
    finally:
        bar.close()
    return result


def analyze_model(
    model: nn.Module,
    tokenizer,
    text: str | None = None,
    settings: AnalysisSettings | None = None,
    *,
    progress: bool = True,
    label: str = "model",
) -> dict:
    """``diagnose_model`` as the JSON-ready entry of ``analysis.json`` (no files written)."""
    return diagnose_model(model, tokenizer, text, settings, progress=progress, label=label).to_dict()


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
        result = diagnose_model(model, tokenizer, text, settings, progress=progress, label=label)
        del model
        local = Path(str(path))
        result.extra["path"] = str(local.resolve()) if local.exists() else str(path)
        result.extra["plots"] = plot_model(result, output / label, output)
        results.append(result)
    data = {
        "format": FORMAT,
        "settings": {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(settings).items()},
        "models": [result.to_dict() for result in results],
        "comparison_plots": plot_comparison(results, output) if len(results) > 1 else {},
    }
    atomic_write_json(output / "analysis.json", data)
    return data


__all__ = [
    "AnalysisSettings",
    "analyze",
    "analyze_model",
    "diagnose_model",
    "evidence_contrast",
    "first_token_mass",
    "forward_without_cache",
    "attention_layers",
    "load_for_analysis",
    "plot_comparison",
    "plot_model",
]
