"""``qkmap eval MODEL --tasks ... [lm-eval flags]``: lm-eval's own CLI with the ``qkmap`` model type registered.

The hand-over is ``qkmap_hf.lm_eval.run_lm_eval_cli`` (lm-eval's public console-script entry, the bundled task pack
on ``--include_path``); every lm-eval flag passes untouched. Conveniences on top, translated here:

- a leading ``MODEL`` becomes ``--model qkmap --model_args pretrained=MODEL`` (merged with any ``--model_args``);
- dashed spellings of lm-eval's flags (``--output-path``, ``--batch-size``, ...) are accepted (lm-eval 0.4's long
  options all use underscores);
- ``qkmap eval ls tasks`` / ``qkmap eval validate --tasks ...`` forward to those lm-eval subcommands.
"""

from __future__ import annotations

HELP = "Evaluate a model with lm-eval (all lm-eval flags; bundled offline tasks included)."
USAGE = """usage: qkmap eval MODEL --tasks TASK[,TASK...] [lm-eval flags] [--output-path OUT]
       qkmap eval ls tasks | qkmap eval validate --tasks TASK

MODEL is a local checkpoint folder or a Hub repo id; it is evaluated with lm-eval's model type `qkmap`
(lm-eval's `hf` plus QK-MAP loading). Bundled offline tasks: qkmap_shakespeare_ppl, qkmap_next_line,
qkmap_needle_256/512/1024, qkmap_needle (--metadata needle_words=N), or the tag qkmap_local.
Standard benchmarks (hellaswag, arc_easy, ...) download their datasets from the Hugging Face Hub.
Every other flag is lm-eval's own (dashes or underscores); lm-eval's `run` help follows.
"""
_SUBCOMMANDS = ("ls", "validate")


def _underscored(arg: str) -> str:
    """``--output-path=x`` -> ``--output_path=x``; values, short options and positionals stay as they are."""
    if not arg.startswith("--"):
        return arg
    name, sep, value = arg.partition("=")
    return "--" + name[2:].replace("-", "_") + sep + value


def translate_argv(argv: list[str]) -> list[str]:
    """``qkmap eval`` arguments to ``lm-eval`` arguments (the include path is added by the hand-over)."""
    argv = list(argv)
    if argv and argv[0] in _SUBCOMMANDS:
        return argv
    if argv and argv[0] == "run":
        argv = argv[1:]
    out = [_underscored(arg) for arg in argv]
    prefix: list[str] = []
    if out and not out[0].startswith("-"):
        model = out.pop(0)
        if any(a == "--model_args" or a.startswith("--model_args=") or a == "-a" for a in out) and (
            "pretrained=" in " ".join(out) or '"pretrained"' in " ".join(out)
        ):
            raise SystemExit(f"qkmap eval: MODEL {model!r} given and --model_args also sets pretrained; keep one.")
        prefix = ["--model_args", f"pretrained={model}"]
    if not any(a in ("--model", "-M") or a.startswith("--model=") for a in out):
        prefix = ["--model", "qkmap", *prefix]
    return ["run", *prefix, *out]


def run_raw(argv: list[str]) -> int:
    from ..lm_eval import run_lm_eval_cli
    from .paths import require_path

    if argv and not argv[0].startswith("-") and argv[0] not in (*_SUBCOMMANDS, "run"):
        require_path("MODEL", argv[0], "checkpoint folder", hub_id_ok=True)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return run_lm_eval_cli(["run", "--help"])
    return run_lm_eval_cli(translate_argv(argv))
