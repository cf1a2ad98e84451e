"""The ``qkmap`` command: a thin layer of argument parsing over the library API.

Each subcommand lives in ``qkmap_hf/commands/<name>.py`` and defines ``HELP`` (one line),
``option_classes()`` and ``run(args) -> int``. Its parser is transformers' ``HfArgumentParser`` over those option
dataclasses, one flag (or positional) per field (``qkmap_hf.flags.OptionsParser``); the shared groups (data,
optimization, tuning, conversion, analysis) are composed into them, so no command writes a flag by hand
(docs/architecture.md, "Options"). ``option_overrides()``, where a command has it, changes a flag's argparse settings
for that command only (``qkmap heal`` hides ``--model``). A module that forwards its arguments untouched to
another program (``qkmap eval`` hands over to lm-eval's CLI) defines ``run_raw(argv) -> int`` instead.
Modules load only when their command runs, so ``qkmap --help`` stays fast.

``main`` is the one place that turns a refusal into one line on stderr and exit code 2 (1 for a failed push
validation, whose message lists every problem on its own line): the project's errors
(``ValueError`` subclasses such as ``ConversionError``), file-system errors (``OSError``: missing file, full disk,
permission) and network errors. ``--debug`` (or ``QKMAP_DEBUG=1``) shows the traceback instead.

A command that writes or publishes a folder names it with ``output_folder(args)``; ``main`` holds that folder's
writer lock for the run (``qkmap_hf.locking``: a second writer refuses naming the first one's pid) and removes what
dead runs left beside it. SIGTERM (timeouts, containers, schedulers) is handled like Ctrl-C: the same clean-up
(temporary folders removed, the lock released), one line, and exit code 143 (130 for Ctrl-C).
"""

from __future__ import annotations

import argparse
import errno
import os
import signal
import sys
import threading
import traceback
from importlib import import_module

from .version import __version__

COMMANDS: dict[str, str] = {
    "demo": "qkmap_hf.commands.demo",
    "convert": "qkmap_hf.commands.convert",
    "verify": "qkmap_hf.commands.verify",
    "train": "qkmap_hf.commands.train",
    "heal": "qkmap_hf.commands.heal",
    "compare": "qkmap_hf.commands.compare",
    "eval": "qkmap_hf.commands.eval",
    "analyze": "qkmap_hf.commands.analyze",
    "card": "qkmap_hf.commands.card",
    "push": "qkmap_hf.commands.push",
    "serve": "qkmap_hf.commands.serve",
    "kernels": "qkmap_hf.commands.kernels",
}


DEBUG_ENV = "QKMAP_DEBUG"
EXIT_REFUSED = 2
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 128 + signal.SIGTERM


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the program is, so that every clean-up that Ctrl-C runs runs for it too."""


def _raise_terminated(signum, frame) -> None:
    raise Terminated()


def _command_module(name: str):
    return import_module(COMMANDS[name])


def build_parser(progs: dict[str, str] | None = None) -> argparse.ArgumentParser:
    """The ``qkmap`` parser; ``progs`` renames a subcommand in its usage lines (a script that runs only it)."""
    parser = argparse.ArgumentParser(
        prog="qkmap",
        description="QK-MAP attention for Hugging Face transformers: convert, train, evaluate and publish models.",
    )
    parser.add_argument("--version", action="version", version=f"qkmap-hf {__version__}")
    parser.add_argument("--debug", action="store_true", help=f"show the traceback of an error (or set {DEBUG_ENV}=1)")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_command_parser)
    for name in COMMANDS:
        module = _command_module(name)
        subparsers.add_parser(
            name,
            help=module.HELP,
            description=module.HELP,
            add_help=not hasattr(module, "run_raw"),
            option_classes=module.option_classes() if hasattr(module, "option_classes") else (),
            overrides=module.option_overrides() if hasattr(module, "option_overrides") else None,
            **({"prog": progs[name]} if progs and name in progs else {}),
        )
    return parser


def _command_parser(
    option_classes: tuple[type, ...] = (), overrides: dict | None = None, **kwargs
) -> argparse.ArgumentParser:
    """A subcommand's parser: ``HfArgumentParser`` over its option dataclasses, or a plain one (``qkmap eval``)."""
    if option_classes:
        from .flags import make_parser

        return make_parser(option_classes, overrides, **kwargs)
    return argparse.ArgumentParser(**kwargs)


def refusal_types() -> tuple[type[BaseException], ...]:
    """Errors that are the user's input or the machine's state, not a bug: one line, exit code 2."""
    types: list[type[BaseException]] = [ValueError, OSError, ImportError]
    for module, name in (
        ("httpx2", "HTTPError"),  # huggingface_hub >= 2 (connection refused, timeouts, DNS)
        ("httpx", "HTTPError"),
        ("requests", "RequestException"),
        ("safetensors", "SafetensorError"),  # truncated or corrupt weight files
        ("huggingface_hub.errors", "StrictDataclassError"),  # a config field of the wrong type (transformers' configs)
    ):
        try:
            types.append(getattr(import_module(module), name))
        except (ImportError, AttributeError):
            continue
    return tuple(types)


_OS_HINTS = {
    errno.ENOSPC: "free some disk space and run the command again",
    errno.EACCES: "check the permissions of that path",
    errno.ENOENT: "check the path",
    errno.EROFS: "choose a writable location",
}


def describe_error(error: BaseException) -> str:
    """The message (which names the file/field/option); for a bare OS error the path, the cause and a hint."""
    name = type(error).__name__
    if isinstance(error, OSError) and error.filename is not None and error.strerror:
        where = f"{error.filename} -> {error.filename2}" if error.filename2 else str(error.filename)
        hint = _OS_HINTS.get(error.errno)
        return f"{where}: {error.strerror}" + (f"; {hint}." if hint else ".")
    text = str(error).strip()
    if any(klass.__name__ == "StrictDataclassError" for klass in type(error).__mro__):
        # a config field of the wrong type, not a network error: "Validation error for field 'x':\n    ..." in one line
        return "invalid config: " + " ".join(text.split())
    if not text:
        text = name
    if type(error).__module__.split(".")[0] in ("httpx", "httpx2", "requests", "urllib3", "huggingface_hub"):
        text = " ".join(text.split())
        if name.startswith("Hf"):  # the Hub answered, with an error status
            return f"the Hub refused the request ({name}): {text}. Check the repo id, the token and its rights."
        if not isinstance(error, ValueError):
            return f"network error ({name}): {text}. Check the connection, HF_ENDPOINT and the token."
    return text


def _take_debug_flag(argv: list[str]) -> bool:
    """Remove ``--debug`` (anywhere; before the command only for commands that forward their arguments)."""
    raw = bool(argv) and argv[0] in COMMANDS and hasattr(_command_module(argv[0]), "run_raw")
    scope = 1 if raw else len(argv)
    found = "--debug" in argv[:scope] or (bool(argv) and argv[0] == "--debug")
    if found:
        argv.remove("--debug")
    return found


def run_command(name: str, argv: list[str] | None = None, prog: str | None = None) -> int:
    """``qkmap NAME ARGV`` as a program of its own (``conversion/convert_llama_to_qkmap.py``), with ``main``'s
    error handling and exit codes; ``prog`` names it in messages."""
    return main([name, *(sys.argv[1:] if argv is None else argv)], prog=prog)


def main(argv: list[str] | None = None, *, prog: str | None = None) -> int:
    """Run ``qkmap ...``; refusals become one line on stderr and exit code 2 (see the module docstring)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no")
    debug = _take_debug_flag(argv) or debug
    command = f"qkmap {argv[0]}" if argv and argv[0] in COMMANDS else "qkmap"
    command = prog or command
    on_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_terminated) if on_main_thread else None
    try:
        return _dispatch(argv, {argv[0]: prog} if prog and argv else None)
    except KeyboardInterrupt as error:
        if debug:
            traceback.print_exc()
        if isinstance(error, Terminated):
            print(f"{command}: terminated (SIGTERM); temporary files removed.", file=sys.stderr)
            return EXIT_TERMINATED
        print(f"{command}: interrupted.", file=sys.stderr)
        return EXIT_INTERRUPTED
    except refusal_types() as error:
        if debug:
            traceback.print_exc()
        print(f"{command}: error: {describe_error(error)}", file=sys.stderr)
        if not debug:
            print(f"{command}: (run with --debug or {DEBUG_ENV}=1 for the traceback)", file=sys.stderr)
        return getattr(error, "exit_code", EXIT_REFUSED)  # a push validation report exits 1
    finally:
        if on_main_thread:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def _dispatch(argv: list[str], progs: dict[str, str] | None = None) -> int:
    if argv and argv[0] in COMMANDS and hasattr(module := _command_module(argv[0]), "run_raw"):
        return int(module.run_raw(argv[1:]) or 0)
    parser = build_parser(progs)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    from .locking import claim_output

    module = _command_module(args.command)
    folder = module.output_folder(args) if hasattr(module, "output_folder") else None
    with claim_output(folder, f"qkmap {args.command}"):
        return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
