"""``qkmap analyze MODEL [--compare OTHER ...] --text FILE --output-dir OUT``: the paper's attention diagnostics."""

from __future__ import annotations

import argparse

HELP = "Attention diagnostics (input-scale sensitivity, first-token mass, evidence contrast) as JSON and PNG plots."


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from error


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from error


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="checkpoint folder or Hub id (any causal LM with q_proj/k_proj: Llama, QK-MAP)")
    parser.add_argument(
        "--compare", nargs="+", action="extend", default=[], metavar="MODEL", help="models to put beside it"
    )
    parser.add_argument("--text", help="UTF-8 text for analyses 1-2 (default: the bundled Tempest passages)")
    parser.add_argument("--output-dir", required=True, help="folder for analysis.json and the PNG plots")
    parser.add_argument("--scales", type=_floats, default=(0.5, 2.0, 4.0), help="input-scale factors (default 0.5,2,4)")
    parser.add_argument("--max-tokens", type=int, default=256, help="tokens per text window (default 256)")
    parser.add_argument("--num-windows", type=int, default=4, help="text windows, one batch (default 4)")
    parser.add_argument(
        "--lengths", type=_ints, default=(256, 512, 1024), help="long-context lengths in tokens (default 256,512,1024)"
    )
    parser.add_argument("--needle-examples", type=int, default=4, help="examples per length (default 4)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic examples")
    parser.add_argument(
        "--trust-remote-code", action="store_true", help="run modeling code shipped with a non-QK-MAP checkpoint"
    )
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")
    parser.add_argument(
        "--dtype", default="float32", choices=("float32", "bfloat16", "float16"), help="weights dtype (default float32)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument(
        "--task", help="run the claims' probes on synthetic task sequences instead of text, e.g. mqar:num_pairs=4"
    )
    parser.add_argument("--task-length", type=int, default=128, help="task sequence length (default 128)")
    parser.add_argument(
        "--task-examples", type=int, default=32, help="task sequences from the report split (default 32)"
    )
    parser.add_argument(
        "--key-scales", type=_floats, default=(0.5, 2.0), help="factors for the evidence key's k_proj (default 0.5,2)"
    )


def run(args: argparse.Namespace) -> int:
    import torch

    from ..analysis import AnalysisSettings, analyze
    from .paths import require_path

    for model in (args.model, *args.compare):
        require_path("MODEL", model, "checkpoint folder", hub_id_ok=True)
    if args.task:
        return run_task(args)
    require_path("--text", args.text, "text file")
    settings = AnalysisSettings(
        scales=args.scales,
        max_tokens=args.max_tokens,
        num_windows=args.num_windows,
        context_lengths=args.lengths,
        needle_examples=args.needle_examples,
        seed=args.seed,
    )
    data = analyze(
        [args.model, *args.compare],
        args.output_dir,
        text_file=args.text,
        settings=settings,
        trust_remote_code=args.trust_remote_code,
        dtype=getattr(torch, args.dtype),
        device=args.device,
        progress=not args.no_progress,
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
    from ..task_probes import mqar_probes
    from ..training.synthetic import MQARTask, parse_task, task_spec

    task = parse_task(args.task)
    if not isinstance(task, MQARTask):
        raise ValueError(f"--task {args.task}: the probes are implemented for mqar only (docs/synthetic-tasks.md).")
    for name in ("task_length", "task_examples"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be a positive integer.")
    results = []
    for path in (args.model, *args.compare):
        model, _ = load_for_analysis(path, trust_remote_code=args.trust_remote_code, dtype=getattr(torch, args.dtype))
        entry = mqar_probes(
            model.to(args.device), task, args.task_length, args.task_examples, args.seed, args.key_scales
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
    atomic_write_json(out / "task_analysis.json", {"task": task_spec(task), "models": results})
    print(f"wrote {out / 'task_analysis.json'}")
    return 0


def summary_line(entry: dict) -> str:
    """One line per model: every measure's headline number, as analysis.json holds it."""
    parts = [f"{entry['label']} ({entry.get('qk_mode') or entry.get('model_type')}):"]
    scale = ", ".join(f"x{s}: {v:.3g}" for s, v in entry["scale_sensitivity"]["mean"].items())
    parts.append(f"scale sensitivity {scale};")
    parts.append(f"first-token mass {entry['first_token_mass']['mean']:.4f};")
    if entry.get("attention_distance"):
        parts.append(f"attention distance {entry['attention_distance']['mean']:.1f} tok;")
    if entry.get("position_only_share"):
        parts.append(f"position-only logit share {entry['position_only_share']['mean']:.3f};")
    if entry.get("key_scale_sensitivity"):
        key = entry["key_scale_sensitivity"]
        parts.append(f"key x{key['factor']:g} gain {key['mean_gain']:+.4f};")
    contrast = ", ".join(
        f"{v['tokens_mean']} tok: {v['mean_log2_lift']:+.3f}" for v in entry["evidence_contrast"]["by_length"].values()
    )
    parts.append(f"evidence log2 lift {contrast};")
    answer = (entry.get("answer_contrast") or {}).get("by_length") or {}
    if answer:
        lifts = ", ".join(f"{v['tokens_mean']} tok: {v['mean_log2_lift']:+.3f}" for v in answer.values())
        parts.append(f"answer log2 lift {lifts};")
    if entry.get("phase"):
        parts.append(f"phase regime: {entry['phase']['regime']}")
    return " ".join(parts).rstrip(";")
