"""The research pages' verdicts: one rule, every entry computed from a committed record, and the committed
verdicts.json and research page in step with the records."""

from __future__ import annotations

import json

import pytest

from qkmap_lab import verdicts
from qkmap_lab.verdicts import BEGIN, END, collect, page_block, rule, with_block

FIELDS = {"claim", "setting", "comparison", "metric", "better", "difference", "interval", "seeds", "steps", "verdict"}


@pytest.mark.parametrize(
    ("interval", "better", "expected"),
    [
        ([-0.3, -0.1], "lower", "supported"),
        ([0.1, 0.3], "lower", "not supported"),
        ([-0.1, 0.2], "lower", "inconclusive"),
        ([0.1, 0.3], "higher", "supported"),
        ([-0.3, -0.1], "higher", "not supported"),
        ([0.0, 0.0], "higher", "inconclusive"),  # every arm at 100 %: no difference, and no equivalence either
        (None, "lower", "inconclusive"),  # too few seeds for an interval
    ],
)
def test_the_rule(interval, better, expected):
    assert rule(interval, better) == expected


def test_every_entry_comes_from_its_record_by_the_rule():
    entries = collect()
    assert len(entries) >= 20
    for entry in entries:
        assert rule(entry.interval, entry.better) == entry.verdict
        assert entry.seeds >= 3 and entry.steps > 0 and entry.better in ("lower", "higher")
        assert (verdicts.REPO / entry.record).is_file()
    # Claim 1 at 1000 steps (the stability study), re-read from its record: the research page's prose says both
    # intervals contain 0, so both lines must be inconclusive.
    stability = json.loads((verdicts.RECORDS / "stability" / "report" / "stability.json").read_text())
    from_stability = [e for e in entries if e.record.endswith("stability.json")]
    assert len(from_stability) == 2
    for entry in from_stability:
        paired = stability["arms"]["qk_map"][f"vs_{entry.comparison.split(' - ')[1]}"]
        assert entry.interval == [paired["low"], paired["high"]] and entry.steps == 1000
        assert paired["low"] < 0 < paired["high"] and entry.verdict == "inconclusive"


def test_comparisons_fixed_by_construction_say_so():
    against_norm_on_scale = [e for e in collect() if e.comparison == "qk_map - qk_norm" and "scale" in e.metric]
    assert against_norm_on_scale and all("by construction" in e.note for e in against_norm_on_scale)


def test_the_committed_verdicts_and_research_page_are_those_of_the_records():
    """``qkmap-lab verdicts --check``: run ``qkmap-lab verdicts`` after a record changes."""
    committed = json.loads(verdicts.VERDICTS_FILE.read_text())
    assert [{k: v for k, v in e.items() if k in FIELDS} for e in committed["verdicts"]] == [
        {k: v for k, v in vars(e).items() if k in FIELDS} for e in collect()
    ]
    assert verdicts.main(["--check"]) == 0


def test_the_page_block_is_replaced_between_its_markers_and_a_page_without_them_is_refused():
    page = f"intro\n{BEGIN}\nold lines\n{END}\noutro\n"
    block = page_block(collect()[:2])
    updated = with_block(page, block)
    assert updated.startswith("intro\n") and updated.endswith("\noutro\n") and "old lines" not in updated
    assert with_block(updated, block) == updated
    with pytest.raises(ValueError, match="verdict markers are missing"):
        with_block("no markers here", block)


def test_pilot_runs_say_they_decide_nothing_at_length():
    entries = collect()
    short = [e for e in entries if e.steps < verdicts.PILOT_STEPS]
    assert short and all("pilot" in e.note for e in short)
    assert all("pilot" not in e.note for e in entries if e.steps >= verdicts.PILOT_STEPS)


def test_every_line_says_what_each_arm_was_tuned_on_and_what_chose_it():
    for entry in collect():
        assert "each arm tuned on " in entry.setting and "on the tuning split (seeds 1000)" in entry.setting
    pilot = [e for e in collect() if e.record.endswith("claims.json")]
    assert pilot and all("learning rate not tuned" in e.setting for e in pilot)
    assert all("learning rate not tuned" not in e.setting for e in collect() if e not in pilot)
