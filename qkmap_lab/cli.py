"""``qkmap-lab COMMAND ...``: the lab's reports, each the ``main`` of its module (loaded only when it runs)."""

from __future__ import annotations

import sys
from importlib import import_module

COMMANDS: dict[str, tuple[str, str]] = {
    "paper-claims": ("qkmap_lab.paper_claims", "the paper's four claims measured on a sweep's saved models"),
    "stability": ("qkmap_lab.stability", "stability report of a learning-rate sweep"),
    "task-report": ("qkmap_lab.task_report", "accuracy report of a synthetic-task sweep"),
    "verdicts": ("qkmap_lab.verdicts", "every research verdict by one rule, into verdicts.json and the research page"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {help_line}" for name, (_, help_line) in COMMANDS.items()]
    return "usage: qkmap-lab COMMAND [ARGS ...]\n\ncommands:\n" + "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), end="")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"qkmap-lab: unknown command {name!r}; choose one of: {', '.join(COMMANDS)}.", file=sys.stderr)
        return 2
    return import_module(COMMANDS[name][0]).main(rest)


if __name__ == "__main__":
    raise SystemExit(main())
