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


# lm-eval's numeric flags, checked before the hand-over (lm-eval's own messages for --limit -3 are internal ones):
# flag -> (kind, smallest allowed value); --batch_size also takes "auto" or "auto:N".
_NUMERIC_FLAGS = {
    "--limit": (float, 0.0),
    "--num_fewshot": (int, 0),
    "--batch_size": (int, 1),
    "--max_batch_size": (int, 1),
    "--bootstrap_iters": (int, 0),
}


def check_numeric_flags(argv: list[str]) -> None:
    """``ValueError`` naming the flag for a value of lm-eval's numeric flags that is not a finite number in range
    (``--limit`` must be positive: a fraction of each task below 1, a count of examples from 1)."""
    import math

    for index, arg in enumerate(argv):
        name, sep, value = arg.partition("=")
        if name not in _NUMERIC_FLAGS:
            continue
        if not sep:
            if index + 1 >= len(argv):
                continue  # lm-eval names the missing value itself
            value = argv[index + 1]
        kind, smallest = _NUMERIC_FLAGS[name]
        if name == "--batch_size" and (value == "auto" or value.startswith("auto:")):
            value = value.partition(":")[2] or "1"
        try:
            number = kind(value) if kind is int else float(value)
        except ValueError:
            raise ValueError(f"{name} {value!r}: must be {'an integer' if kind is int else 'a number'}.") from None
        if kind is float and not math.isfinite(number):
            raise ValueError(f"{name} {value}: must be a finite number.")
        if number < smallest or (name == "--limit" and number == 0):
            bound = "positive" if name == "--limit" or smallest == 1 else "at least 0"
            raise ValueError(f"{name} {value}: must be {bound}.")


def run_raw(argv: list[str]) -> int:
    from ..lm_eval import run_lm_eval_cli
    from .paths import require_path

    if argv and not argv[0].startswith("-") and argv[0] not in (*_SUBCOMMANDS, "run"):
        require_path("MODEL", argv[0], "checkpoint folder", hub_id_ok=True)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return run_lm_eval_cli(["run", "--help"])
    translated = translate_argv(argv)
    check_numeric_flags(translated)
    return run_lm_eval_cli(translated)
