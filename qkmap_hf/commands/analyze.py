"""``qkmap analyze MODEL [--compare OTHER ...] --text FILE --output-dir OUT``: the paper's attention diagnostics."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Literal

from ..flags import comma_floats, parsed_by
from ..task_sources import DEFAULT_KEY_SCALES, DEFAULT_PROBE_EXAMPLES

HELP = "Attention diagnostics (input-scale sensitivity, first-token mass, evidence contrast) as JSON and PNG plots."


@dataclass
class AnalyzeArguments:
    """What ``qkmap analyze`` adds to the analysis group (``AnalysisSettings``): the models, where the results go,
    how the models load, and the synthetic-task probes (``--task``)."""

    model: str = field(
        metadata={
            "positional": True,
            "help": "checkpoint folder or Hub id (any causal LM with q_proj/k_proj: Llama, QK-MAP)",
        }
    )
    output_dir: str = field(metadata={"help": "folder for analysis.json and the PNG plots"})
    compare: list[str] = field(
        default_factory=list, metadata={"help": "models to put beside it", "action": "extend", "metavar": "MODEL"}
    )
    trust_remote_code: bool = field(
        default=False, metadata={"help": "run modeling code shipped with a non-QK-MAP checkpoint", "switch": True}
    )
    device: str = field(default="cpu", metadata={"help": "torch device"})
    dtype: Literal["float32", "bfloat16", "float16"] = field(default="float32", metadata={"help": "weights dtype"})
    progress: bool = field(default=True, metadata={"help": "no progress bars", "switch": True})
    task: str | None = field(
        default=None,
        metadata={
            "help": "run the claims' probes on synthetic task sequences instead of text, NAME[:FIELD=VALUE,...] "
            "from an installed task source (the lab's: mqar or salience), e.g. mqar:num_pairs=4"
        },
    )
    task_length: int = field(default=128, metadata={"help": "task sequence length"})
    task_examples: int = field(
        default=DEFAULT_PROBE_EXAMPLES, metadata={"help": "task sequences from the report split"}
    )
    key_scales: tuple[float, ...] = field(
        default=DEFAULT_KEY_SCALES,
        metadata={"help": "factors for the evidence key's k_proj, comma-separated", "action": parsed_by(comma_floats)},
    )


def option_classes() -> tuple[type, ...]:
    from ..analysis import AnalysisSettings

    return (AnalyzeArguments, AnalysisSettings)


def run(args: argparse.Namespace) -> int:
    import torch

    from ..analysis import AnalysisSettings, analyze
    from ..flags import options_from_namespace
    from .paths import require_path

    for model in (args.model, *args.compare):
        require_path("MODEL", model, "checkpoint folder", hub_id_ok=True)
    if args.task:
        return run_task(args)
    require_path("--text", args.text_file, "text file")
    settings = options_from_namespace(AnalysisSettings, args)
    data = analyze(
        [args.model, *args.compare],
        args.output_dir,
        text_file=settings.text_file,
        settings=settings,
        trust_remote_code=args.trust_remote_code,
        dtype=getattr(torch, args.dtype),
        device=args.device,
        progress=args.progress,
    )
    for entry in data["models"]:
        print(summary_line(entry))
    print(f"wrote {args.output_dir}/analysis.json and plots")
    return 0


def run_task(args: argparse.Namespace) -> int:
    """``--task``: ``task_probes`` on every model, into ``OUTPUT_DIR/task_analysis.json``."""
    from pathlib import Path

    import torch

    from ..analysis import load_for_analysis
    from ..fileio import atomic_write_json
    from ..task_sources import parse_task

    source, task = parse_task(args.task)
    if args.task.partition(":")[0] not in source.probed_names:
        raise ValueError(f"--task {args.task!r}: the probes run on {' or '.join(source.probed_names)} only.")
    for name in ("task_length", "task_examples"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be a positive integer.")
    results = []
    for path in (args.model, *args.compare):
        model, _ = load_for_analysis(path, trust_remote_code=args.trust_remote_code, dtype=getattr(torch, args.dtype))
        entry = source.probe(
            model.to(args.device), task, args.task_length, args.task_examples, args.seed, tuple(args.key_scales)
        )
        entry["model"] = str(path)
        results.append(entry)
        scale = ", ".join(
            f"x{k}: {v['answers_changed']:.2f}" for k, v in entry["evidence_key_scale"]["by_factor"].items()
        )
        print(
            f"{path}: accuracy {entry['accuracy']:.3f}; evidence log2 lift {entry['evidence_contrast']['mean_log2_lift']:+.3f} "
            f"(best head {entry['evidence_contrast']['best_head_log2_lift']:+.3f}); answers changed by key scale {scale}"
        )
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "task_analysis.json", {"task": source.spec(task), "models": results})
    print(f"wrote {out / 'task_analysis.json'}")
    return 0


def summary_line(entry: dict) -> str:
    """One line per model: every measure's headline number, as analysis.json holds it (read through its typed
    results, ``qkmap_hf.diagnostics.ModelDiagnostics``)."""
    from ..diagnostics import ModelDiagnostics

    result = ModelDiagnostics.from_dict(entry)
    parts = [f"{result.label} ({result.qk_mode or result.model_type}):"]
    scale = ", ".join(f"x{s}: {v:.3g}" for s, v in result.scale_sensitivity.mean.items())
    parts.append(f"scale sensitivity {scale};")
    parts.append(f"first-token mass {result.first_token_mass.mean:.4f};")
    if result.attention_distance:
        parts.append(f"attention distance {result.attention_distance.mean:.1f} tok;")
    if result.position_only_share:
        parts.append(f"position-only logit share {result.position_only_share.mean:.3f};")
    if result.key_scale_sensitivity:
        key = result.key_scale_sensitivity
        parts.append(f"key x{key.factor:g} gain {key.mean_gain:+.4f};")
    for name, measured in (("evidence", result.evidence_contrast), ("answer", result.answer_contrast)):
        by_length = measured.by_length if measured else {}
        if by_length or name == "evidence":
            lifts = ", ".join(f"{v.tokens_mean} tok: {v.mean_log2_lift:+.3f}" for v in by_length.values())
            parts.append(f"{name} log2 lift {lifts};")
    if result.phase:
        parts.append(f"phase regime: {result.phase.regime}")
    return " ".join(parts).rstrip(";")
