"""``qkmap eval MODEL --tasks ... [lm-eval flags]``: lm-eval's own CLI with the ``qkmap`` model type registered.

lm-eval discovers no plugins, so this command imports ``qkmap_hf.lm_eval`` (which registers ``--model qkmap``),
adds the bundled task pack to ``--include_path`` and then runs lm-eval's CLI (``lm_eval._cli.HarnessCLI``, the
object behind the ``lm-eval`` console script) with every other flag untouched. Conveniences on top:

- a leading ``MODEL`` becomes ``--model qkmap --model_args pretrained=MODEL`` (merged with any ``--model_args``);
- dashed spellings of lm-eval's flags (``--output-path``, ``--batch-size``, ...) are accepted;
- ``qkmap eval ls tasks`` / ``qkmap eval validate --tasks ...`` forward to those lm-eval subcommands.
"""

from __future__ import annotations

import sys

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


def _run_options() -> set[str]:
    """Long option strings of lm-eval's ``run`` subcommand (to translate dashed spellings)."""
    from lm_eval._cli import HarnessCLI

    run_parser = HarnessCLI()._subparsers.choices["run"]
    return {option for action in run_parser._actions for option in action.option_strings if option.startswith("--")}


def translate_argv(argv: list[str]) -> list[str]:
    """``qkmap eval`` arguments to ``lm-eval`` arguments (without the include path, added after parsing)."""
    argv = list(argv)
    if argv and argv[0] in _SUBCOMMANDS:
        return argv
    if argv and argv[0] == "run":
        argv = argv[1:]
    options = _run_options()
    out: list[str] = []
    for arg in argv:
        name, sep, value = arg.partition("=")
        if name.startswith("--") and name not in options and name.replace("-", "_").replace("__", "--", 1) in options:
            arg = name.replace("-", "_").replace("__", "--", 1) + sep + value
        out.append(arg)
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
    from lm_eval._cli import HarnessCLI
    from lm_eval.utils import setup_logging

    import qkmap_hf.lm_eval  # noqa: F401  (registers --model qkmap)

    from ..tasks import task_pack_dir
    from .paths import require_path

    if argv and not argv[0].startswith("-") and argv[0] not in (*_SUBCOMMANDS, "run"):
        require_path("MODEL", argv[0], "checkpoint folder", hub_id_ok=True)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        lm_eval_argv = ["run", "--help"]
    else:
        lm_eval_argv = translate_argv(argv)
    setup_logging()
    saved_argv = sys.argv
    sys.argv = ["lm-eval", *lm_eval_argv]
    try:
        cli = HarnessCLI()
        args = cli.parse_args()
        if hasattr(args, "include_path"):
            # lm-eval's TaskManager accepts several paths; the user's own --include_path keeps working.
            user_path = args.include_path
            args.include_path = [str(task_pack_dir())] + ([user_path] if user_path else [])
        cli.execute(args)
    except (ValueError, OSError) as error:
        print(f"qkmap eval: {error}", file=sys.stderr)
        return 2
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    finally:
        sys.argv = saved_argv
    return 0
