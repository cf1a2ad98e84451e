"""Model cards for QK-MAP checkpoints, rendered through huggingface_hub's ``ModelCard`` / ``ModelCardData``.

A card says what the model is (attention mode, QK-MAP settings, architecture), where it came from (conversion
and training records written next to the weights), how it scored (lm-eval results JSON turned into the card's
``model-index``) and how its attention behaves (plots and numbers from ``qkmap analyze``). The Jinja template lives
in ``qkmap_hf/model_cards/`` (the top-level ``model_cards/`` is a link to it) so that installed wheels carry it.

Provenance records (``qkmap_hf.provenance``: ``qkmap_conversion.json``, ``qkmap_training.json``,
``qkmap_healing.json`` in the model folder) are read when present. ``write_model_card(provenance=...)`` adds one
more record: a ``ProvenanceRecord``, or a dict whose ``"kind"`` (``"conversion"``, ``"training"``, anything else)
names its section; a record of a kind that has a file replaces that file's record in the card.
"""

from __future__ import annotations

import html
import json
import re
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import quote

from huggingface_hub import EvalResult, ModelCard, ModelCardData

from .diagnostics import FirstTokenMass, PhaseStatistics, ScaleSensitivity
from .diagnostics.base import read
from .diagnostics.contrast import evidence_from_dict
from .fileio import atomic_copy, atomic_write_text
from .loading import is_repo_id
from .provenance import PROVENANCE_FILES, ProvenanceRecord, load_provenance
from .safety import contained_path
from .version import __version__

TEMPLATE_NAME = "qkmap_model_card.md"
ANALYSIS_SUBDIR = "analysis"
BASE_TAGS = ["qk-map", "qkmap", "custom_code", "text-generation"]
DEFAULT_LICENSE = "apache-2.0"
GENERATED_MARKER = "- **Produced with:** qkmap-hf"  # a line of the template: this README is one of our cards
_BASE_MODEL_KEYS = ("base_model", "source_model_id", "source_repo_id", "source_model", "source")
_MODE_DESCRIPTIONS = {
    "standard": "Llama attention, unchanged (the baseline).",
    "qk_norm": "QK-Norm: per-head RMSNorm on queries and keys before RoPE (the Qwen3 layout, a baseline).",
    "qk_map": "QK-MAP: queries and keys pass through sin/cos features at learnable frequencies, so their "
    "magnitude is encoded as bounded phases instead of being normalised away.",
}
_ARCHITECTURE_FIELDS = (
    "num_hidden_layers",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "max_position_embeddings",
    "rope_theta",
)


# --------------------------------------------------------------------------------------------------
# escaping: names, descriptions and records come from files and flags; the card is Markdown with HTML allowed
# --------------------------------------------------------------------------------------------------

_MARKDOWN_MARKUP = re.compile(r"([\\`*\[\]|~])")  # what opens code, emphasis, links, table cells, strikethrough


def markdown_text(value: Any) -> str:
    """``value`` as literal text on one Markdown line: HTML (``<script>``, ``&``) and Markdown markup escaped, line
    breaks (which could open a heading, a list or a code fence) folded into spaces."""
    text = html.escape(" ".join(str(value).split()), quote=False)
    return _MARKDOWN_MARKUP.sub(r"\\\1", text)


def code_text(value: Any) -> str:
    """``value`` for the inside of a `code span` of the template: no backtick (it would close the span, and no
    escape works inside one) and no line break."""
    return " ".join(str(value).split()).replace("`", "'")


def fenced_json(data: Any) -> str:
    """``data`` as JSON for a fenced code block: backticks written as the JSON escape ``\\u0060`` (the same JSON),
    so no value can close the fence and turn the rest of the record into Markdown."""
    return json.dumps(data, indent=2, sort_keys=True, default=str).replace("`", "\\u0060")


def repo_id_for_code(name: str) -> str:
    """A name usable as a Hub repo id in the card's code (``repo = "..."``, ``qkmap eval ...``): characters a
    repo id cannot hold become ``-``, so a folder name cannot break out of the string or the command line."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.") or "model"


def template_path(name: str = TEMPLATE_NAME) -> Path:
    """Path of a bundled card template; works from a source tree, an editable install and a wheel."""
    path = Path(str(resources.files("qkmap_hf") / "model_cards" / name))
    if not path.is_file():
        raise FileNotFoundError(
            f"Model card template {name!r} is missing from {path.parent}; reinstall qkmap-hf (the wheel must include "
            "qkmap_hf/model_cards/*)."
        )
    return path


def _read_json(path: Path, what: str) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON ({error}); {what} must be a JSON object.") from error
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds a {type(data).__name__}; {what} must be a JSON object.")
    return data


# --------------------------------------------------------------------------------------------------
# lm-eval results
# --------------------------------------------------------------------------------------------------


def load_lm_eval_results(path: str | Path) -> dict:
    """Read lm-eval results: one ``results_*.json`` file, or a folder searched recursively for them.

    Several files (one run per task set) are merged oldest first, so a task's newest score wins.
    """
    path = Path(path)
    if path.is_dir():
        files = sorted(path.rglob("results_*.json"), key=lambda p: (p.stat().st_mtime, p.name))
        if not files:
            raise FileNotFoundError(
                f"No lm-eval results_*.json under {path}; pass the --output-path folder of `qkmap eval` or one "
                "results file."
            )
    elif path.is_file():
        files = [path]
    else:
        raise FileNotFoundError(f"lm-eval results {path} do not exist; pass a results_*.json file or its folder.")
    merged: dict[str, Any] = {"results": {}, "configs": {}, "n-shot": {}, "sources": []}
    for file in files:
        data = _read_json(file, "an lm-eval results file")
        if not isinstance(data.get("results"), dict):
            raise ValueError(f"{file} has no 'results' mapping; it is not an lm-eval results file.")
        for key in ("results", "configs", "n-shot"):
            merged[key].update(data.get(key) or {})
        for key in ("config", "lm_eval_version", "date", "model_name", "git_hash"):
            if key in data:
                merged[key] = data[key]
        merged["sources"].append(str(file))
    return merged


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def eval_rows(results: dict) -> list[dict[str, Any]]:
    """One row per (task, metric, filter) with value, stderr and n-shot; non-numeric entries are skipped."""
    rows = []
    for task, metrics in sorted(results.get("results", {}).items()):
        shots = (results.get("n-shot") or {}).get(task)
        for key, value in metrics.items():
            if "," not in key or "_stderr," in key:
                continue
            metric, filter_name = key.split(",", 1)
            number = _number(value)
            if number is None:
                continue
            stderr = _number(metrics.get(f"{metric}_stderr,{filter_name}"))
            rows.append(
                {
                    "task": metrics.get("alias", task).strip() or task,
                    "task_id": task,
                    "metric": metric if filter_name == "none" else f"{metric} ({filter_name})",
                    "metric_id": metric,
                    "value_raw": number,
                    "value": f"{number:.4f}",
                    "stderr": f"{stderr:.4f}" if stderr is not None else "",
                    "fewshot": shots if shots is not None else "",
                }
            )
    return rows


def eval_results_for_card(results: dict) -> list[EvalResult]:
    """``EvalResult`` entries (the card's ``model-index``) from merged lm-eval results."""
    configs = results.get("configs") or {}
    out = []
    for row in eval_rows(results):
        config = configs.get(row["task_id"], {})
        split = config.get("test_split") or config.get("validation_split")
        shots = row["fewshot"]
        out.append(
            EvalResult(
                task_type="text-generation",
                task_name="Text Generation",
                dataset_type=config.get("dataset_path") or row["task_id"],
                dataset_name=row["task"],
                dataset_config=config.get("dataset_name") or None,
                dataset_split=split,
                dataset_args={"num_few_shot": shots} if shots != "" else None,
                metric_type=row["metric_id"],
                metric_value=round(row["value_raw"], 6),
                metric_name=f"{row['metric']} ({shots}-shot)" if shots != "" else row["metric"],
                source_name="lm-evaluation-harness",
                source_url="https://github.com/EleutherAI/lm-evaluation-harness",
            )
        )
    return out


# --------------------------------------------------------------------------------------------------
# provenance and settings
# --------------------------------------------------------------------------------------------------


def _format_value(value: Any) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, (list, tuple)) and len(value) <= 8 and all(not isinstance(v, (dict, list)) for v in value):
        return ", ".join(_format_value(v) for v in value)
    return str(value)


def _provenance_items(record: dict, prefix: str = "") -> list[tuple[str, str]]:
    """Scalar fields of a record, nested dicts flattened one level (``verification.max_kl``)."""
    items = []
    for key, value in record.items():
        if value is None or (isinstance(value, list) and len(value) > 8):
            continue
        if isinstance(value, dict):
            if not prefix:
                items += _provenance_items(value, prefix=f"{key}.")
            continue
        items.append((f"{prefix}{key}", _format_value(value)))
    return items


def _provenance_sections(records: dict[str, dict]) -> list[dict[str, Any]]:
    return [
        {
            "title": markdown_text(kind.replace("_", " ").capitalize()),
            "source": html.escape(PROVENANCE_FILES.get(kind, "provenance")),
            "items": [(markdown_text(key), markdown_text(value)) for key, value in _provenance_items(record)[:30]],
            "json": fenced_json(record),
        }
        for kind, record in records.items()
    ]


def _base_model(records: dict[str, dict]) -> str | None:
    """A Hub id from the records (``base_model``, ``source_model_id``, ...); local paths are not Hub ids."""
    for record in records.values():
        for key in _BASE_MODEL_KEYS:
            value = record.get(key)
            if isinstance(value, str) and is_repo_id(value, with_owner=True) and not Path(value).exists():
                return value
    return None


def _datasets(records: dict[str, dict]) -> list[str] | None:
    found: list[str] = []
    for record in records.values():
        value = record.get("datasets", record.get("dataset"))
        for item in [value] if isinstance(value, str) else value or []:
            if isinstance(item, str) and is_repo_id(item, with_owner=True) and item not in found:
                found.append(item)
    return found or None


def _settings(config: dict) -> list[tuple[str, str]]:
    """``(name, value)`` rows of the settings table, escaped (the name for its code span, the value as text)."""
    return [(code_text(name), markdown_text(value)) for name, value in _raw_settings(config)]


def _raw_settings(config: dict) -> list[tuple[str, str]]:
    if config.get("qk_mode", "standard") == "qk_map":
        rows = [(key, _format_value(value)) for key, value in sorted(config.items()) if key.startswith("qkmap_")]
        head_dim = config.get("head_dim") or config.get("hidden_size", 0) // max(
            config.get("num_attention_heads", 1), 1
        )
        m = config.get("qkmap_input_dim") or head_dim
        width = 2 * int(config.get("qkmap_num_frequencies", 1)) * int(m)
        rows.append(("query/key width (2 F m)", str(width)))
        return rows
    rows = [("qk_mode", config.get("qk_mode", "standard (not a qkmap config)"))]
    if "rms_norm_eps" in config:
        rows.append(("rms_norm_eps", _format_value(config["rms_norm_eps"])))
    return rows


def _phase_rows(model_entry: dict | None) -> tuple[list[dict[str, str]], str | None]:
    phase = read(model_entry, PhaseStatistics)
    if phase is None:
        return [], None
    rows = [
        {
            "layer": markdown_text(layer.layer),
            "query_median": f"{layer.query.median:.3g}",
            "query_p90": f"{layer.query.p90:.3g}",
            "key_median": f"{layer.key.median:.3g}",
            "key_p90": f"{layer.key.p90:.3g}",
        }
        for layer in phase.layers
    ]
    return rows, phase.regime  # re-derived from the quantiles: one definition (qkmap_hf.phases)


# --------------------------------------------------------------------------------------------------
# analysis
# --------------------------------------------------------------------------------------------------


def _pick_analysis_model(analysis: dict, model_dir: Path) -> dict | None:
    models = analysis.get("models") or []
    for entry in models:
        if entry.get("path") and Path(entry["path"]).resolve() == model_dir.resolve():
            return entry
    return models[0] if models else None


def _import_analysis(analysis_dir: Path, model_dir: Path) -> tuple[dict, dict]:
    """Copy the plots (and JSON) of ``analysis_dir`` into ``model_dir/analysis``; return (analysis, model entry)."""
    analysis_json = analysis_dir / "analysis.json" if analysis_dir.is_dir() else analysis_dir
    if not analysis_json.is_file():
        raise FileNotFoundError(
            f"{analysis_json} does not exist; pass the --output-dir of `qkmap analyze` (it holds analysis.json)."
        )
    analysis = _read_json(analysis_json, "analysis.json")
    if not str(analysis.get("format", "")).startswith("qkmap-analysis/"):
        raise ValueError(
            f"{analysis_json} is not a `qkmap analyze` result (its 'format' is {analysis.get('format')!r})."
        )
    entry = _pick_analysis_model(analysis, model_dir)
    source_root = analysis_json.parent
    target_root = model_dir / ANALYSIS_SUBDIR
    plots = dict((entry or {}).get("plots") or {})
    plots.update({f"comparison: {k}": v for k, v in (analysis.get("comparison_plots") or {}).items()})
    copied: dict[str, str] = {}
    for title, relative in plots.items():  # a plot named ../secret would be copied into the model folder
        contained_path(source_root, relative, source=analysis_json, what=f"plot {title!r} ->")
    if source_root.resolve() != target_root.resolve():
        target_root.mkdir(parents=True, exist_ok=True)
        for title, relative in plots.items():
            source = source_root / relative
            if not source.is_file():
                raise FileNotFoundError(f"{analysis_json} lists plot {relative!r} but {source} is missing.")
            name = relative.replace("/", "__")
            atomic_copy(source, target_root / name)
            copied[title] = f"{ANALYSIS_SUBDIR}/{name}"
        atomic_copy(analysis_json, target_root / "analysis.json")
    else:
        copied = {title: f"{ANALYSIS_SUBDIR}/{relative}" for title, relative in plots.items()}
    entry = dict(entry or {}, card_plots=copied)
    return analysis, entry


def _analysis_context(analysis: dict, entry: dict) -> dict[str, Any]:
    settings = analysis.get("settings", {})
    scale = read(entry, ScaleSensitivity)
    first = read(entry, FirstTokenMass)
    contrast = evidence_from_dict(entry["evidence_contrast"]) if entry.get("evidence_contrast") else None
    return {
        "label": code_text(entry.get("label")),
        "compared_with": [
            code_text(m.get("label")) for m in analysis.get("models") or [] if m.get("label") != entry.get("label")
        ],
        "text_description": markdown_text(
            f"{settings.get('num_windows', '?')} windows of {settings.get('max_tokens', '?')} tokens of "
            f"{Path(str(settings.get('text_file') or 'text')).name}"
        ),
        "scale_summary": [
            {"scale": s, "value": f"{v:.4g}"}
            for s, v in sorted((scale.mean if scale else {}).items(), key=lambda x: float(x[0]))
        ],
        "first_token_mass": f"{first.mean if first else float('nan'):.4f}",
        "uniform_reference": f"{first.uniform_reference if first else float('nan'):.4f}",
        "contrast_summary": [
            {
                "length": markdown_text(values.tokens_mean),
                "mean": f"{values.mean_log2_lift:.3f}",
                "best": f"{values.max_head_log2_lift:.3f}",
            }
            for _length, values in sorted((contrast.by_length if contrast else {}).items(), key=lambda x: int(x[0]))
        ],
        "plots": [
            {"title": markdown_text(title.replace("_", " ").capitalize()), "path": quote(path, safe="/")}
            for title, path in (entry.get("card_plots") or {}).items()
        ],
    }


# --------------------------------------------------------------------------------------------------
# the card
# --------------------------------------------------------------------------------------------------


def render_model_card(
    model_dir: str | Path,
    *,
    provenance: ProvenanceRecord | dict | None = None,
    eval_results: str | Path | None = None,
    analysis_dir: str | Path | None = None,
    license: str | None = None,
    model_name: str | None = None,
    template: str | Path | None = None,
) -> ModelCard:
    """Build (without writing README.md) the card of the checkpoint in ``model_dir``; see ``write_model_card``."""
    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} does not exist; `model_dir` must be a saved checkpoint folder.")
    config = _read_json(config_path, "config.json")
    records = {kind: record.to_dict() for kind, record in load_provenance(model_dir, provenance).items()}
    qk_mode = config.get("qk_mode", "standard") if config.get("model_type") == "qkmap" else "standard"
    name = model_name or model_dir.resolve().name
    base_model = _base_model(records)
    results = load_lm_eval_results(eval_results) if eval_results is not None else None
    analysis_ctx, phase_rows, phase_regime = None, [], None
    if analysis_dir is not None:
        analysis, entry = _import_analysis(Path(analysis_dir), model_dir)
        analysis_ctx = _analysis_context(analysis, entry)
        phase_rows, phase_regime = _phase_rows(entry)

    license = license or next((r["license"] for r in records.values() if isinstance(r.get("license"), str)), None)
    tags = list(BASE_TAGS) + [f"qk-mode-{qk_mode.replace('_', '-')}"]
    if config.get("model_type") != "qkmap":
        tags.remove("custom_code")
    card_data = ModelCardData(
        language="en",
        license=license or DEFAULT_LICENSE,
        library_name="transformers",
        pipeline_tag="text-generation",
        tags=tags,
        base_model=base_model,
        datasets=_datasets(records),
        model_name=name if results else None,  # only the model-index uses it
        eval_results=eval_results_for_card(results) if results else None,
    )
    architecture = ", ".join(f"{key}={config[key]}" for key in _ARCHITECTURE_FIELDS if key in config)
    kind = "converted from " + base_model if base_model else ("trained" if "training" in records else "built")
    summary = (
        f"A {markdown_text(config.get('num_hidden_layers', '?'))}-layer causal language model with "
        f"`{code_text(qk_mode)}` attention, {markdown_text(kind)} with qkmap-hf."
    )
    card = ModelCard.from_template(
        card_data,
        template_path=str(template or template_path()),
        model_id=markdown_text(name),
        summary=summary,
        qk_mode=code_text(qk_mode),
        mode_description=_MODE_DESCRIPTIONS.get(qk_mode) or markdown_text(qk_mode),
        architecture_line=markdown_text(architecture),
        remote_code=bool(config.get("auto_map")),
        qkmap_version=__version__,
        settings=_settings(config),
        phase_rows=phase_rows,
        phase_regime=phase_regime,
        usage_repo_id=model_name
        if model_name and is_repo_id(model_name, with_owner=True)
        else f"your-org/{repo_id_for_code(name)}",
        provenance_sections=_provenance_sections(records),
        eval_rows=[{key: markdown_text(value) for key, value in row.items()} for row in eval_rows(results or {})],
        eval_meta={
            "lm_eval_version": markdown_text(version) if (version := (results or {}).get("lm_eval_version")) else None,
            "limit": markdown_text(_format_value(limit))
            if (limit := ((results or {}).get("config") or {}).get("limit"))
            else None,
        },
        analysis=analysis_ctx,
    )
    return card


def check_card_replaceable(model_dir: str | Path) -> None:
    """``FileExistsError`` if ``model_dir/README.md`` is not a card of ours (hand-written): it is kept. Checked by
    ``qkmap heal`` before training too, so that a card it may not replace does not cost the run."""
    readme = Path(model_dir) / "README.md"
    old_text = readme.read_text(encoding="utf-8", errors="replace") if readme.is_file() else GENERATED_MARKER
    if GENERATED_MARKER not in old_text:
        raise FileExistsError(
            f"{readme} was not written by qkmap card (hand-written?) and is kept; move it aside, or pass "
            "--overwrite (overwrite=True) to replace it."
        )


def write_model_card(
    model_dir: str | Path,
    *,
    provenance: ProvenanceRecord | dict | None = None,
    eval_results: str | Path | None = None,
    analysis_dir: str | Path | None = None,
    license: str | None = None,
    model_name: str | None = None,
    overwrite: bool = False,
) -> Path:
    """Write ``model_dir/README.md``: QK-MAP settings from config.json, provenance, lm-eval scores, analysis plots.

    Args:
        model_dir: a saved checkpoint folder (config.json required).
        provenance: an extra record (see module docstring); ``qkmap_conversion.json``/``qkmap_training.json``
            in ``model_dir`` are read anyway.
        eval_results: an lm-eval ``results_*.json`` or the ``--output-path`` folder holding them.
        analysis_dir: the ``--output-dir`` of ``qkmap analyze``; its plots are copied into ``model_dir/analysis``.
        license: card license; default: a ``license`` field of the provenance records, else apache-2.0.
        model_name: name in the card and ``model-index`` (e.g. the Hub repo id); default: the folder name.
        overwrite: replace a README.md that is not a card of ours (hand-written); without it that is refused.

    Returns the README path. The card is parsed back with ``ModelCard.load`` before it replaces any old README.
    """
    model_dir = Path(model_dir)
    readme = model_dir / "README.md"
    if not overwrite:
        check_card_replaceable(model_dir)
    card = render_model_card(
        model_dir,
        provenance=provenance,
        eval_results=eval_results,
        analysis_dir=analysis_dir,
        license=license,
        model_name=model_name,
    )
    text = str(card)
    ModelCard(text, ignore_metadata_errors=False)  # fails here, not on the Hub, if the metadata does not parse
    atomic_write_text(readme, text)
    return readme


__all__ = [
    "eval_results_for_card",
    "eval_rows",
    "load_lm_eval_results",
    "load_provenance",
    "render_model_card",
    "template_path",
    "write_model_card",
]
