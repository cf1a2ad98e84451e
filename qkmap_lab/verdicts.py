"""Every verdict on the research pages, by one rule, from the committed records (``qkmap-lab verdicts``).

One entry per comparison: ``qk_map`` against one baseline, on one metric, in one study. The rule:

- **supported**: the paired 95 % interval over report seeds excludes 0 on the claimed side;
- **not supported**: it excludes 0 on the other side;
- **inconclusive**: otherwise (it contains 0, or there are too few seeds for an interval).

"No difference" is not a verdict of this rule: it needs an equivalence test (two one-sided tests) at a margin stated
before the runs, and gets an entry of its own (``kind: "equivalence"``). The claims' directions and baselines have
one definition, ``paper_claims.CLAIMS`` (text) and ``task_report.task_claims`` (synthetic tasks); the studies read
are ``STUDIES``. ``qkmap-lab verdicts`` writes ``docs/results/verdicts.json`` and the verdict lines between the
markers of the research page; ``--check`` fails where either is out of date.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from qkmap_hf.fileio import atomic_write_text

SUBJECT = "qk_map"
BETTER = {-1: "lower", +1: "higher"}
REPO = Path(__file__).resolve().parent.parent
RECORDS = REPO / "docs" / "results"
VERDICTS_FILE = RECORDS / "verdicts.json"
RESEARCH_PAGE = REPO / "docs" / "research.md"
# Below this many steps a run is a pilot: the rule still reads its interval, and the line says it decides nothing.
PILOT_STEPS = 1000
BEGIN, END = "<!-- verdicts: begin (qkmap-lab verdicts writes these lines) -->", "<!-- verdicts: end -->"
# Comparisons whose answer is fixed by construction: reported with the note, so no reader takes them for evidence.
BY_CONSTRUCTION = {
    ("key_scale_abs", "qk_norm"): "QK-Norm divides a key's scale out, so its value is 0 by construction",
    ("answers_changed_x2", "qk_norm"): "QK-Norm divides a key's scale out, so its value is 0 by construction",
    ("answers_changed_x0.5", "qk_norm"): "QK-Norm divides a key's scale out, so its value is 0 by construction",
}


@dataclass(frozen=True)
class Verdict:
    """One comparison of ``verdicts.json``."""

    claim: str
    setting: str
    comparison: str
    metric: str
    better: str
    difference: float
    interval: list[float] | None
    seeds: int
    steps: int
    verdict: str
    record: str
    kind: str = "difference"
    note: str = ""


def rule(interval: list[float] | None, better: str) -> str:
    """The one rule of the module docstring, for an interval of ``subject - baseline``."""
    if interval is None:
        return "inconclusive"
    low, high = interval
    claimed_below = better == "lower"
    if (high < 0) if claimed_below else (low > 0):
        return "supported"
    if (low > 0) if claimed_below else (high < 0):
        return "not supported"
    return "inconclusive"


def _entry(
    claim: str, setting: str, metric: str, sign: int, baseline: str, paired: dict, steps: int, record: Path, name: str
) -> Verdict:
    interval = None if paired.get("low") is None else [float(paired["low"]), float(paired["high"])]
    better = BETTER[sign]
    return Verdict(
        claim=claim,
        setting=setting,
        comparison=f"{SUBJECT} - {baseline}",
        metric=metric,
        better=better,
        difference=float(paired["mean"]),
        interval=interval,
        seeds=int(paired["n"]),
        steps=steps,
        verdict=rule(interval, better),
        record=record.relative_to(REPO).as_posix(),
        note=BY_CONSTRUCTION.get((name, baseline), ""),
    )


def _settings(summary: Path) -> dict[str, Any]:
    return json.loads(summary.read_text())["settings"]


def _tuning_text(summary: Path) -> str:
    """What each arm was tuned on and which split and seeds chose it, read from the sweep's own summary."""
    document = json.loads(summary.read_text())
    grid = document["settings"].get("tune") or {}
    if not grid:
        return "no arm tuned"
    knobs = "; ".join(f"{knob} in {{{', '.join(map(str, values))}}}" for knob, values in grid.items())
    seeds = (document.get("splits") or {}).get("tuning", {}).get("seeds")
    chosen = f" on the tuning split (seeds {', '.join(map(str, seeds))})" if seeds else ""
    fixed = "" if "learning_rate" in grid else ", the learning rate not tuned (one for every arm)"
    return f"each arm tuned on {knobs}{chosen}{fixed}"


def _setting_text(summary: Path, what: str) -> str:
    settings = _settings(summary)
    config = {k: v for k, v in (settings.get("config") or {}).items() if v is not None}
    size = f"preset {settings['preset']}" + (f" with {config}" if config else "")
    batch = f", batch {settings['batch_size']}" if settings.get("batch_size") else ""
    return f"{what}, {size}, block {settings['block_size']}{batch}; {_tuning_text(summary)}"


def from_paper_claims(folder: Path) -> list[Verdict]:
    """The four claims on text: ``paper_claims``' tables, each judged metric against each of its baselines."""
    from qkmap_lab.paper_claims import CLAIMS

    record = folder / "claims.json"
    tables = json.loads(record.read_text())["tables"]
    settings = _settings(folder / "summary.json")
    setting = _setting_text(folder / "summary.json", "byte-level Shakespeare")
    entries = []
    for claim, metrics in CLAIMS.items():
        for metric in metrics:
            row = tables.get(metric.name, {}).get(SUBJECT, {})
            for baseline in metric.baselines if metric.claimed_sign else ():
                if f"vs_{baseline}" in row:
                    paired = row[f"vs_{baseline}"]
                    entry = _entry(claim, setting, metric.label, metric.claimed_sign, baseline, paired,
                                   settings["steps"], record, metric.name)  # fmt: skip
                    if metric.name == "first_token_mass":
                        entry = replace(entry, note=_largest_mean(tables[metric.name], "mass on token 0"))
                    entries.append(entry)
    return entries


def _with_length_note(entry: Verdict) -> Verdict:
    if entry.steps >= PILOT_STEPS:
        return entry
    pilot = f"a {entry.steps}-step pilot, too short to decide the claim at length"
    return replace(entry, note=f"{entry.note}; {pilot}" if entry.note else pilot)


def _largest_mean(table: dict[str, dict], what: str) -> str:
    """Context for a difference of small numbers: the largest arm mean (a first-token sink would be near 1)."""
    arm, row = max(table.items(), key=lambda item: item[1]["mean"])
    return f"every arm's mean {what} is at most {row['mean']:.3g} ({arm}): no arm formed a sink"


def from_stability(folder: Path) -> list[Verdict]:
    """Claim 1 from a learning-rate sweep: each arm at its own tuned rate, report-split loss over report seeds."""
    from qkmap_lab.paper_claims import CLAIMS

    claim = next(iter(CLAIMS))
    record = folder / "report" / "stability.json"
    arms = json.loads(record.read_text())["arms"]
    shard = sorted((folder / "sweep").glob("shard-*/summary.json")) or [folder / "sweep" / "summary.json"]
    settings = _settings(shard[0])
    setting = _setting_text(shard[0], "byte-level Shakespeare")
    return [
        _entry(claim, setting, "report-split validation loss", -1, baseline, arms[SUBJECT][f"vs_{baseline}"],
               settings["steps"], record, "val_loss")
        for baseline in ("standard", "qk_norm")
        if f"vs_{baseline}" in arms.get(SUBJECT, {})
    ]  # fmt: skip


def from_task_report(folder: Path) -> list[Verdict]:
    """The claims on the synthetic tasks: final accuracy and ``task_report.task_claims``' probe measures."""
    from qkmap_lab.task_report import task_claims

    record = folder / "task_report.json"
    report = json.loads(record.read_text())
    summaries = sorted(folder.glob("*summary.json"))
    steps = _settings(summaries[0])["steps"] if summaries else 0
    tuning = f"; {_tuning_text(summaries[0])}" if summaries else ""
    entries = []
    sweeps = [name for name in report if name not in ("tuning", "probes", "verdicts", "generalization")]
    for sweep in sweeps:
        for name, metric in task_claims().items():
            if name == "final_accuracy":
                row = report[sweep].get(SUBJECT, {})
            else:
                row = report.get("probes", {}).get(sweep, {}).get(SUBJECT, {}).get(name, {})
            for baseline in metric.baselines:
                if f"vs_{baseline}" in row:
                    entries.append(
                        _entry(metric.label, f"synthetic task {sweep} ({folder.name}){tuning}", metric.label, metric.claimed_sign, baseline,
                               row[f"vs_{baseline}"], steps, record, name)
                    )  # fmt: skip
    return entries


# The studies whose verdicts the research pages state: (reader, record folder under docs/results).
STUDIES: tuple[tuple[str, str], ...] = (
    ("stability", "stability"),
    ("paper_claims", "paper-claims"),
    ("task_report", "synthetic-tasks"),
    ("task_report", "synthetic-tasks-salience"),
    ("task_report", "synthetic-tasks-curriculum"),
)
READERS = {"stability": from_stability, "paper_claims": from_paper_claims, "task_report": from_task_report}


def collect(records: Path = RECORDS) -> list[Verdict]:
    """Every verdict of ``STUDIES``, in their order."""
    return [_with_length_note(entry) for reader, folder in STUDIES for entry in READERS[reader](records / folder)]


def _number(value: float) -> str:
    return f"{value:+.4g}"


def line(entry: Verdict) -> str:
    """One verdict as one line of the research page."""
    interval = (
        "no interval" if entry.interval is None else f"[{_number(entry.interval[0])}, {_number(entry.interval[1])}]"
    )
    note = f" ({entry.note})" if entry.note else ""
    return (
        f"- **{entry.verdict}**: {entry.metric}, {entry.better} claimed; {entry.comparison} {_number(entry.difference)} "
        f"{interval}, {entry.seeds} seeds, {entry.steps} steps; {entry.setting}{note} ([record](../{entry.record}))"
    )


def page_block(entries: list[Verdict]) -> str:
    """The lines between the research page's markers: the entries grouped by claim."""
    lines: list[str] = [BEGIN, ""]
    for claim in dict.fromkeys(entry.claim for entry in entries):
        lines += [f"**{claim}**", "", *(line(e) for e in entries if e.claim == claim), ""]
    return "\n".join([*lines, END])


def with_block(page: str, block: str) -> str:
    """``page`` with the text between its markers replaced by ``block``; a page without markers is refused."""
    if BEGIN not in page or END not in page:
        raise ValueError(f"{RESEARCH_PAGE}: the verdict markers are missing; put {BEGIN!r} and {END!r} on two lines.")
    head, rest = page.split(BEGIN, 1)
    return head + block + rest.split(END, 1)[1]


def document(entries: list[Verdict]) -> dict[str, Any]:
    return {"rule": __doc__.split("\n\n")[1], "verdicts": [asdict(entry) for entry in entries]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="qkmap-lab verdicts", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if verdicts.json or the research page is stale")
    args = parser.parse_args(argv)
    entries = collect()
    wanted_json = json.dumps(document(entries), indent=2) + "\n"
    page = RESEARCH_PAGE.read_text()
    wanted_page = with_block(page, page_block(entries))
    if args.check:
        stale = [p for p, ok in ((VERDICTS_FILE, VERDICTS_FILE.exists() and VERDICTS_FILE.read_text() == wanted_json),
                                 (RESEARCH_PAGE, page == wanted_page)) if not ok]  # fmt: skip
        for path in stale:
            print(f"{path.relative_to(REPO)} is out of date: run qkmap-lab verdicts", file=sys.stderr)
        return 1 if stale else 0
    atomic_write_text(VERDICTS_FILE, wanted_json)
    atomic_write_text(RESEARCH_PAGE, wanted_page)
    counts = {v: sum(e.verdict == v for e in entries) for v in ("supported", "not supported", "inconclusive")}
    print(f"wrote {len(entries)} verdicts ({counts}) to {VERDICTS_FILE.relative_to(REPO)} and {RESEARCH_PAGE.name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
