"""Every command line that README.md documents, run through the real ``qkmap`` parser, so a README command cannot rot.

The commands come from README.md itself (its ``bash`` blocks: each ``qkmap ...`` or ``python3 -m qkmap_hf ...``,
``&&``-chains split), never from a list kept here. Each one is parsed by ``qkmap_hf.cli.main`` exactly as
documented, up to the hand-over to the command (``run``; for ``qkmap eval``, lm-eval's own parser and then its
``execute``), which is intercepted: every documented flag must be accepted and land in the options, and a
command whose flags are option dataclasses must build them. The cheap ones (``CHEAP``) then run for real, in a
fresh folder whose README placeholders (``SRC``, ``text.txt``, ``plays/``, model folders) are tiny inputs.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import shlex
import shutil
from pathlib import Path

import pytest

from qkmap_hf import cli
from qkmap_hf.packaging import convert_checkpoint
from tests.hostile import tiny_llama

README = Path(__file__).resolve().parents[2] / "README.md"
PROGRAMS = (["qkmap"], ["python3", "-m", "qkmap_hf"], ["python", "-m", "qkmap_hf"])
CHEAP = {"convert", "analyze"}  # seconds on a tiny model; the others train, serve, upload or fetch a real checkpoint
TEXT = "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer. " * 30

pytestmark = pytest.mark.usefixtures("one_thread")


def readme_commands() -> list[list[str]]:
    """The argv (after the program) of each ``qkmap`` command line in README.md's ``bash`` blocks."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", README.read_text(encoding="utf-8"), re.S):
        for line in block.splitlines():
            words = shlex.split(line, comments=True)
            while words:
                part, words = (
                    (words[: words.index("&&")], words[words.index("&&") + 1 :]) if "&&" in words else (words, [])
                )
                for program in PROGRAMS:
                    if part[: len(program)] == program:
                        commands.append(part[len(program) :])
    return commands


COMMANDS = readme_commands()


def _flags_and_positionals(argv: list[str]) -> tuple[list[tuple[str, str | None]], list[str]]:
    """``(--flag, value or None)`` pairs and the positional words of a documented command (after its name)."""
    flags, positionals, rest = [], [], list(argv[1:])
    while rest:
        word = rest.pop(0)
        if word.startswith("--"):
            value = rest.pop(0) if rest and not rest[0].startswith("-") else None
            flags.append((word, value))
        else:
            positionals.append(word)
    return flags, positionals


def _survives(text: str, parsed: object) -> bool:
    """Every name and number of a documented value is still in what the parser made of it (``plays/`` ->
    ``['plays/']``, ``logit_scale_multiplier=1,4`` -> ``{'logit_scale_multiplier': [1.0, 4.0]}``)."""
    rendered = str(parsed)
    numbers = {float(n) for n in re.findall(r"\d+(?:\.\d+)?", rendered)}
    names = re.findall(r"[A-Za-z_]{2,}", text)
    return all(name in rendered for name in names) and all(
        float(n) in numbers for n in re.findall(r"\d+(?:\.\d+)?", text)
    )


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    """The tiny stand-ins of README's placeholders: a Llama folder (SRC) and its exact QK-MAP conversion."""
    root = tmp_path_factory.mktemp("readme")
    source = tiny_llama(root / "llama")
    return {"source": source, "converted": convert_checkpoint(source, root / "converted", progress=False)}


def _materialize(word: str, inputs: dict[str, Path], *, positional: bool) -> None:
    """Create the placeholder ``word`` in the working folder: SRC, a text file, a data folder, or (a positional
    that is no Hub id like ORG/NAME) a model folder. Other flag values (``exact``) are no paths."""
    path = Path(word)
    if word == "SRC":
        shutil.copytree(inputs["source"], path)
    elif path.suffix == ".txt":
        path.write_text(TEXT, encoding="utf-8")
    elif word.endswith("/"):
        path.mkdir(parents=True)
        (path / "play.txt").write_text(TEXT, encoding="utf-8")
    elif positional and "/" not in word:
        shutil.copytree(inputs["converted"], path)


def _parse(argv: list[str], monkeypatch, capsys):
    """``qkmap ARGV`` through ``cli.main`` up to the hand-over; returns the namespace the command would get."""
    handed: list = []
    module = cli._command_module(argv[0])
    if hasattr(module, "run_raw"):  # qkmap eval: lm-eval's own parser, then its execute
        from lm_eval.__main__ import HarnessCLI

        monkeypatch.setattr(HarnessCLI, "execute", lambda self, args: handed.append(args))
    else:
        monkeypatch.setattr(module, "run", lambda args: handed.append(args) or 0)
    code = cli.main(list(argv))
    err = capsys.readouterr().err
    assert code == 0 and len(handed) == 1, f"qkmap {shlex.join(argv)} was not accepted (exit {code}):\n{err}"
    return module, handed[0]


def _flag_destinations(command: str) -> dict[str, str]:
    """Every spelling of every flag of ``qkmap COMMAND`` (aliases included) -> the namespace field it sets."""
    parser = cli.build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {flag: action.dest for action in subparsers.choices[command]._actions for flag in action.option_strings}


def test_readme_documents_qkmap_commands():
    assert len(COMMANDS) >= 5, COMMANDS
    unknown = [argv for argv in COMMANDS if not argv or argv[0] not in cli.COMMANDS]
    assert not unknown, f"README.md documents commands qkmap does not have: {unknown}"


@pytest.mark.parametrize("argv", COMMANDS, ids=[shlex.join(argv) for argv in COMMANDS])
def test_readme_command(argv, inputs, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with monkeypatch.context() as patch:
        module, args = _parse(argv, patch, capsys)
    values = vars(args)
    dests = _flag_destinations(argv[0])
    flags, positionals = _flags_and_positionals(argv)
    for flag, value in flags:
        dest = dests.get(flag, flag[2:].replace("-", "_"))  # qkmap eval: lm-eval's parser, its own names
        assert dest in values, f"{flag}: not an option of qkmap {argv[0]} ({sorted(dests)})"
        if value is None:
            assert values[dest] is True, f"{flag} = {values[dest]!r}"
        else:
            assert _survives(value, values[dest]), f"{flag} {value} became {values[dest]!r}"
    for word in positionals:
        assert any(_survives(word, v) for v in values.values()), f"{word} is in no option: {values}"
    if hasattr(module, "option_classes"):  # train, heal, compare: the documented flags build valid options
        for cls in module.option_classes():
            fields = {f.name: values[f.name] for f in dataclasses.fields(cls) if f.init and f.name in values}
            cls(**fields)

    if argv[0] not in CHEAP:
        return
    outputs = {getattr(args, "output_dir", None), getattr(module, "output_folder", lambda a: None)(args)}
    words = [(word, True) for word in positionals] + [(value, False) for _, value in flags if value is not None]
    for word, positional in words:
        if word not in outputs and not Path(word).exists():
            _materialize(word, inputs, positional=positional)
    code = cli.main(list(argv))
    err = capsys.readouterr().err
    assert code == 0, f"qkmap {shlex.join(argv)} failed (exit {code}):\n{err}"
    written = [Path(p) for p in outputs if p is not None]
    assert written and all(any(p.iterdir()) for p in written), f"qkmap {shlex.join(argv)} wrote nothing"
