"""Check a converted model against its source on real text: is the conversion exact, and how far did it drift?

``verify_conversion`` runs both models in float32 over the same tokens and reports perplexities, per-token
KL(source || converted) (float64 over log-softmax), the largest logit difference and greedy-generation
agreement. It also records, per QK-MAP layer, the phase ``omega * |z|`` of queries and keys and the regime it puts
the model in (``qkmap_hf.phases``, the one definition shared with ``qkmap heal``, ``qkmap analyze`` and the card):
``linear`` is standard attention in disguise (an exact conversion), ``periodic`` uses the bounded features.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any

import torch

from .fileio import atomic_write_text
from .filenames import VERIFICATION_NAME
from .loading import load_causal_lm, load_source_tokenizer, split_gguf_path
from .phases import PhaseRecorder
from .safety import Vocabulary, check_same_vocabulary, tokenizer_file

# How much a verification reads and generates by default: ``qkmap verify``, ``qkmap convert --verify`` and the demo.
DEFAULT_VERIFY_TOKENS = 512
DEFAULT_GENERATE_TOKENS = 64


@dataclasses.dataclass
class VerificationReport:
    """The numbers of one source/converted comparison (``to_json`` for files, ``table`` for people)."""

    source: str
    converted: str
    tokens_evaluated: int
    source_perplexity: float
    converted_perplexity: float
    mean_kl: float
    max_kl: float
    max_logit_diff: float
    greedy_tokens: int
    greedy_matching: int
    first_divergence: int | None
    dtype: str = "float32"
    qkmap_init: str | None = None
    qkmap_exact_frequency: float | None = None
    phase: dict[str, Any] | None = None

    @property
    def greedy_identical(self) -> bool:
        return self.first_divergence is None

    @property
    def greedy_agreement(self) -> float:
        return self.greedy_matching / self.greedy_tokens if self.greedy_tokens else 1.0

    def non_finite(self) -> list[str]:
        """Names of the measured numbers that are NaN or infinite: a broken model, never a usable conversion."""
        numbers = ("source_perplexity", "converted_perplexity", "mean_kl", "max_kl", "max_logit_diff")
        return [name for name in numbers if not math.isfinite(getattr(self, name))]

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["non_finite"] = self.non_finite()
        data["greedy_identical"] = self.greedy_identical
        data["greedy_agreement"] = self.greedy_agreement
        return data

    def summary(self) -> dict[str, Any]:
        """The headline numbers (for provenance records and model cards)."""
        data = self.to_dict()
        data.pop("phase")
        if self.phase:
            data["phase_regime"] = self.phase["regime"]
            data["phase_median_max"] = self.phase["max_median"]
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    def save(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        atomic_write_text(path, self.to_json())
        return path

    def table(self) -> str:
        rows = [
            ("tokens evaluated", f"{self.tokens_evaluated} ({self.dtype})"),
            ("perplexity, source", f"{self.source_perplexity:.4f}"),
            ("perplexity, converted", f"{self.converted_perplexity:.4f}"),
            ("KL(source||converted) per token, mean", f"{self.mean_kl:.3e}"),
            ("KL(source||converted) per token, max", f"{self.max_kl:.3e}"),
            ("max |logit difference|", f"{self.max_logit_diff:.3e}"),
            (
                f"greedy generation, {self.greedy_tokens} tokens",
                f"{self.greedy_matching}/{self.greedy_tokens} match"
                + (" (identical)" if self.greedy_identical else f" (first divergence at {self.first_divergence})"),
            ),
        ]
        if self.qkmap_init is not None:
            init = {"exact": f"exact, omega_0={self.qkmap_exact_frequency:g}", "native": "native"}.get(
                self.qkmap_init, self.qkmap_init
            )
            rows.insert(0, ("converted init", init))
        if self.phase:
            medians, p90 = self.phase["phase_median"], self.phase["phase_p90"]
            rows.append(("phase omega*|z|, per-layer medians", f"{min(medians):.3g} .. {max(medians):.3g}"))
            rows.append(("phase omega*|z|, per-layer p90", f"{min(p90):.3g} .. {max(p90):.3g}"))
            rows.append(("regime", self.phase["regime_description"]))
        if self.non_finite():
            rows.append(("NON-FINITE (NaN/inf) numbers", ", ".join(self.non_finite())))
        width = max(len(name) for name, _ in rows)
        lines = [f"Conversion check: {self.source} -> {self.converted}"]
        lines += [f"  {name.ljust(width)}  {value}" for name, value in rows]
        return "\n".join(lines)


def _read_text(text: str | os.PathLike) -> str:
    if isinstance(text, os.PathLike) or (
        isinstance(text, str) and len(text) < 4096 and "\n" not in text and os.path.isfile(text)
    ):
        return Path(text).read_text(encoding="utf-8", errors="replace")
    return str(text)


def _load(model_or_path: Any, gguf_file: str | None = None):
    """A model in eval mode: ``PreTrainedModel`` as given, a path loaded in float32 (GGUF or safetensors)."""
    if isinstance(model_or_path, torch.nn.Module):
        return model_or_path.eval(), None
    path, gguf_file = split_gguf_path(model_or_path, gguf_file)
    return load_causal_lm(path, gguf_file=gguf_file, dtype=torch.float32), (path, gguf_file)


def check_verify_counts(max_tokens: int, generate_tokens: int) -> None:
    """``ValueError`` naming the flag: at least 2 tokens to compare predictions, no negative generation length
    (a negative count would slice the text from its end, or be read by ``generate`` as "none")."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 2:
        raise ValueError(f"--max-tokens {max_tokens}: must be at least 2 (one input and one prediction).")
    if isinstance(generate_tokens, bool) or not isinstance(generate_tokens, int) or generate_tokens < 0:
        raise ValueError(f"--generate-tokens {generate_tokens}: must not be negative.")


@torch.no_grad()
def verify_conversion(
    source: Any,
    converted: Any,
    text: str | os.PathLike,
    max_tokens: int = DEFAULT_VERIFY_TOKENS,
    generate_tokens: int = DEFAULT_GENERATE_TOKENS,
    *,
    tokenizer: Any = None,
    source_gguf_file: str | None = None,
    prompt_tokens: int = 32,
    save_to: str | os.PathLike | None = None,
    source_label: str | None = None,
    converted_label: str | None = None,
) -> VerificationReport:
    """Compare ``converted`` with ``source`` on ``text`` (a string or a text file).

    ``source``/``converted`` are models or checkpoint folders (loaded in float32; ``source_gguf_file`` for a GGUF
    source). The tokenizer comes from ``tokenizer``, else the converted folder, else the source folder. Greedy
    generation continues the first ``prompt_tokens`` tokens for exactly ``generate_tokens`` tokens in both
    models. ``save_to``: write the report as JSON there (a folder gets ``verification.json``).
    """
    check_verify_counts(max_tokens, generate_tokens)
    source_model, source_ref = _load(source, source_gguf_file)
    converted_model, converted_ref = _load(converted)
    sides = []
    for model, ref in ((source_model, source_ref), (converted_model, converted_ref)):
        side_tokenizer = None
        if tokenizer is None and ref is not None:
            side_tokenizer = load_source_tokenizer(*ref)
        label = _label(model, ref)
        config_file = label if ref is None or ref[1] else str(Path(label) / "config.json")
        width = model.get_output_embeddings().weight.shape[0]
        sides.append(Vocabulary(tokenizer_file(*ref) if ref else label, side_tokenizer, config_file, width))
    check_same_vocabulary(*sides, purpose="verify compares the two models token by token; pass the source of DST")
    if tokenizer is None:
        tokenizer = sides[1].tokenizer or sides[0].tokenizer
        if tokenizer is None:
            raise ValueError("verify_conversion needs tokenizer=... when neither model comes with a tokenizer.")

    ids = tokenizer(_read_text(text), return_tensors="pt").input_ids[:, :max_tokens]
    if ids.shape[1] < 2:
        raise ValueError(f"the text gives {ids.shape[1]} token(s); at least 2 are needed to compare predictions.")
    device = next(source_model.parameters()).device
    ids = ids.to(device)

    recorder = PhaseRecorder(converted_model, samples_per_pass=1_000_000)
    try:
        source_logits = source_model(ids).logits[0].double()
        converted_logits = (
            converted_model(ids.to(next(converted_model.parameters()).device)).logits[0].double().to(device)
        )
    finally:
        recorder.remove()
    source_logp = source_logits.log_softmax(-1)
    converted_logp = converted_logits.log_softmax(-1)
    kl = (source_logp.exp() * (source_logp - converted_logp)).sum(-1).clamp_min(0.0)
    targets = ids[0, 1:]

    def perplexity(logp: torch.Tensor) -> float:
        return math.exp(-logp[:-1].gather(-1, targets[:, None]).mean().item())

    prompt = ids[:, : max(1, min(prompt_tokens, ids.shape[1] - 1))]
    generated = []
    for model in (source_model, converted_model):
        out = model.generate(
            prompt.to(next(model.parameters()).device),
            attention_mask=torch.ones_like(prompt),
            do_sample=False,
            num_beams=1,
            max_new_tokens=generate_tokens,
            min_new_tokens=generate_tokens,
            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
        )
        generated.append(out[0, prompt.shape[1] :].cpu())
    a, b = generated
    length = min(len(a), len(b))
    matches = (a[:length] == b[:length]).tolist()
    diverged = [i for i, same in enumerate(matches) if not same]
    first = diverged[0] if diverged else (None if len(a) == len(b) else length)

    config = getattr(converted_model, "config", None)
    report = VerificationReport(
        source=source_label or _label(source, source_ref),
        converted=converted_label or _label(converted, converted_ref),
        tokens_evaluated=int(ids.shape[1]),
        source_perplexity=perplexity(source_logp),
        converted_perplexity=perplexity(converted_logp),
        mean_kl=float(kl.mean()),
        max_kl=float(kl.max()),
        max_logit_diff=float((source_logits - converted_logits).abs().max()),
        greedy_tokens=max(len(a), len(b)),
        greedy_matching=int(sum(matches)),
        first_divergence=first,
        dtype=str(next(converted_model.parameters()).dtype).removeprefix("torch."),
        qkmap_init=getattr(config, "qkmap_init", None),
        qkmap_exact_frequency=getattr(config, "qkmap_exact_frequency", None),
        phase=recorder.summary(),
    )
    if save_to is not None:
        target = Path(save_to)
        report.save(target / VERIFICATION_NAME if target.is_dir() else target)
    return report


def _label(obj: Any, ref: tuple[Path, str | None] | None) -> str:
    if ref is not None:
        path, gguf = ref
        return str(path / gguf) if gguf else str(path)
    return getattr(getattr(obj, "config", None), "_name_or_path", None) or type(obj).__name__


__all__ = ["DEFAULT_GENERATE_TOKENS", "DEFAULT_VERIFY_TOKENS", "VerificationReport", "verify_conversion"]
