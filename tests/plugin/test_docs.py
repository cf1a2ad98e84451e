"""The user docs stay guides: every relative link resolves, pages stay short, no issue numbers or dated headings,
and every record under docs/results and docs/benchmarks is in the records' index. Reads files only (no model)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
NOTES = REPO / "qkmap_lab" / "notes"
RECORD_FOLDERS = (DOCS / "results", DOCS / "benchmarks")
RECORDS_INDEX = DOCS / "results" / "INDEX.md"
MAX_LINES = 400
MAX_LINES_OF = {"performance.md": 300}
# A markdown link or image: ](target) or ](target "title"); the target ends at a space or the closing parenthesis.
LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
ISSUE_REFERENCE = re.compile(r"(?<![\w&/])#\d+\b|\bissues?\s+#?\d+", re.IGNORECASE)
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")


def user_pages() -> list[Path]:
    return [REPO / "README.md", *sorted(DOCS.glob("*.md"))]


def linked_pages() -> list[Path]:
    return [*user_pages(), *sorted(NOTES.glob("*.md")), RECORDS_INDEX]


def outside_code(text: str) -> str:
    """``text`` without fenced code blocks and inline code, where ``#1`` or a URL is code, not a reference."""
    text = re.sub(r"^(```|~~~).*?^\1", "", text, flags=re.MULTILINE | re.DOTALL)
    return re.sub(r"`[^`\n]*`", "", text)


def broken_links(page: Path) -> list[str]:
    """The relative link targets of ``page`` that name no existing file or folder (anchors are not checked)."""
    broken = []
    for target in LINK.findall(outside_code(page.read_text(encoding="utf-8"))):
        path = target.split("#", 1)[0]
        if not path or re.match(r"^[a-z][a-z0-9+.-]*:", path, re.IGNORECASE):
            continue  # an anchor on the same page, or a URL / mailto
        if not (page.parent / path).exists():
            broken.append(target)
    return broken


@pytest.mark.parametrize("page", linked_pages(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_relative_link_resolves(page: Path) -> None:
    assert broken_links(page) == [], f"{page.relative_to(REPO)}: links to missing files"


def test_the_link_check_finds_a_broken_link(tmp_path: Path) -> None:
    (tmp_path / "there.md").write_text("# there\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](there.md) [ok with anchor](there.md#there) [web](https://example.org/x) [same page](#top)\n"
        "![missing image](images/none.png) [missing](gone/page.md#part) `[in code](nowhere.md)`\n"
    )
    assert broken_links(page) == ["images/none.png", "gone/page.md#part"]


@pytest.mark.parametrize("page", sorted(DOCS.glob("*.md")), ids=lambda p: p.name)
def test_no_page_is_too_long(page: Path) -> None:
    limit = MAX_LINES_OF.get(page.name, MAX_LINES)
    lines = len(page.read_text(encoding="utf-8").splitlines())
    assert lines <= limit, f"docs/{page.name}: {lines} lines, the limit is {limit}; move detail to qkmap_lab/notes"


@pytest.mark.parametrize("page", user_pages(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_no_issue_numbers_or_dated_headings(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    issues = ISSUE_REFERENCE.findall(outside_code(text))
    dated = [line for line in text.splitlines() if line.startswith("#") and DATE.search(line)]
    assert issues == [], f"{page.relative_to(REPO)}: issue references {issues}; say what, not which issue"
    assert dated == [], f"{page.relative_to(REPO)}: dated headings {dated}; a guide has no dated sections"


def test_the_checks_catch_issue_numbers_and_dates() -> None:
    assert ISSUE_REFERENCE.findall("as issue 52 asks, see #12 and issues 3") == ["issue 52", "#12", "issues 3"]
    assert ISSUE_REFERENCE.findall(outside_code("a `#1` in code, a [link](page.md#part), 1 issue")) == []
    assert DATE.search("## Serving (2026-12-02)")


def test_every_record_is_in_the_index() -> None:
    index = RECORDS_INDEX.read_text(encoding="utf-8")
    listed = set(LINK.findall(index))
    missing = []
    for folder in RECORD_FOLDERS:
        for entry in sorted(folder.iterdir()):
            if entry == RECORDS_INDEX:
                continue
            relative = Path(entry.name) if folder == RECORDS_INDEX.parent else Path("..") / folder.name / entry.name
            target = relative.as_posix() + ("/" if entry.is_dir() else "")
            if target not in listed:
                missing.append(entry.relative_to(REPO).as_posix())
    assert missing == [], f"docs/results/INDEX.md: records not listed {missing}; add a row (command, citing page)"
