"""benchmarks/uptrain_stability.py (issue 19, item 4) end to end on a tiny Llama: stage 1, the sweep, resume, a
diverging rate recorded with L0, and the sham-heal split."""

from __future__ import annotations

import csv
import json
import math
import sys
from pathlib import Path

import pytest

from qkmap_hf.assets import shakespeare_text
from qkmap_hf.training.data import build_datasets, byte_level_tokenizer
from tests.utils import load_float32, tiny_llama_converted_exactly

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import uptrain_stability  # noqa: E402
from heal_smollm2 import split_perplexity  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = ["--block-size", "32", "--batch-size", "2", "--max-eval-blocks", "4", "--max-tokens", "12000",
        "--logging-steps", "1", "--eval-steps", "2", "--monitor-steps", "2"]  # fmt: skip


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> dict[str, Path]:
    """A tiny random Llama (byte-level tokenizer) and some Shakespeare."""
    root = tmp_path_factory.mktemp("uptrain")
    folders = tiny_llama_converted_exactly(root, initializer_range=0.1)
    (root / "text.txt").write_text(shakespeare_text(max_chars=20_000, plays=("hamlet_gut",)), encoding="utf-8")
    return {"src": folders["src"], "text": root / "text.txt"}


def _argv(source: dict[str, Path], out: Path, *extra: str) -> list[str]:
    return ["--source", str(source["src"]), "--data", str(source["text"]), "--output-dir", str(out), *TINY, *extra]


@pytest.mark.slow  # trains 4 runs end to end (~6 s): the fast tier's 90 s budget
def test_sweep_records_real_numbers_resumes_and_records_a_diverged_run_at_l0(source, tmp_path, capsys):
    out = tmp_path / "sweep"
    argv = _argv(source, out, "--arms", "llama", "exact", "--learning-rates", "1e-3", "1e30", "--seeds", "1",
                 "--steps", "6")  # fmt: skip
    assert uptrain_stability.main(argv) == 0
    printed = capsys.readouterr().out
    assert "[uptrain] 4/4 exact-lr1e+30-seed1" in printed and "ETA 0 s" in printed

    with open(out / "uptrain_stability.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert tuple(rows[0]) == uptrain_stability.CSV_FIELDS
    by_run = {(r["arm"], float(r["learning_rate"])): [] for r in rows}
    for row in rows:
        by_run[(row["arm"], float(row["learning_rate"]))].append(row)
    # The exact conversion is the source at step 0: the same held-out loss.
    start = {key: float(next(r for r in run if r["step"] == "0")["held_out_loss"]) for key, run in by_run.items()}
    assert start[("exact", 1e-3)] == pytest.approx(start[("llama", 1e-3)], abs=1e-5)
    assert start[("llama", 1e-3)] == start[("llama", 1e30)]  # same blocks for every run
    # ... and it is the source's loss on the held-out blocks, computed here independently of the Trainer.
    _, held_out, _ = build_datasets([source["text"]], byte_level_tokenizer(), 32, max_eval_blocks=4, max_tokens=12000)
    assert math.log(split_perplexity(load_float32(source["src"]), held_out.blocks)) == pytest.approx(
        start[("llama", 1e-3)], abs=1e-5
    )

    results = uptrain_stability.read_results(out, uptrain_stability.parser().parse_args(argv))
    for arm in ("llama", "exact"):
        sane, absurd = results[(arm, 1e-3, 1)], results[(arm, 1e30, 1)]
        assert sane["diverged"] is None and sane["final_loss"] < sane["initial_loss"]  # it learned something
        assert [r["step"] for r in sane["rows"]] == [0, 1, 2, 4, 6]  # evaluations at 0, 2, 4, 6; probes at 1, 2, 4, 6
        assert all(r["max_logit"] > 0 for r in sane["rows"] if r["step"] > 0)
        assert sane["max_logit_end"] == sane["rows"][-1]["max_logit"]
        # The absurd rate diverges: stopped, recorded with L0 (its held-out loss before the first step).
        assert absurd["diverged"] is not None and absurd["final_loss"] == absurd["initial_loss"]
        assert absurd["rows"][-1]["note"] == "diverged: L0" and absurd["rows"][-1]["step"] == 6
    assert not any(out.glob("runs/*/*.safetensors")) and not any(out.glob("runs/*/checkpoint-*"))  # no weights kept

    summary = json.loads((out / "summary.json").read_text())
    cells = {(c["arm"], c["learning_rate"]): c for c in summary["cells"]}
    exact, llama = cells[("exact", 1e-3)], cells[("llama", 1e-3)]
    assert exact["mean_perplexity"] == pytest.approx(results[("exact", 1e-3, 1)]["final_perplexity"])
    paired = math.exp(results[("exact", 1e-3, 1)]["final_loss"] - results[("llama", 1e-3, 1)]["final_loss"])
    assert exact["ratio_to_llama"] == pytest.approx(paired) and llama["ratio_to_llama"] == pytest.approx(1.0)
    assert cells[("exact", 1e30)]["diverged"] == 1 and exact["diverged"] == 0
    assert (out / "uptrain_stability.png").stat().st_size > 0

    # A rerun trains nothing: every run has its result.json.
    before = {p: p.stat().st_mtime_ns for p in out.glob("runs/*/result.json")}
    assert len(before) == 4
    assert uptrain_stability.main(argv) == 0
    assert "4 done already, 0 to go" in capsys.readouterr().out
    assert {p: p.stat().st_mtime_ns for p in out.glob("runs/*/result.json")} == before

    assert uptrain_stability.main(["--output-dir", str(out), "--markdown"]) == 0  # the run's grid, not the defaults
    table = capsys.readouterr().out
    assert f"| exact | 0.001 | {exact['mean_perplexity']:.2f} (" in table and "| 1/1 |" in table

    # Runs made by processes with subsets of the grid: --summarize writes the summary of the grid its flags name.
    subset = argv[: argv.index("--arms")] + ["--arms", "llama"] + argv[argv.index("--arms") + 3 :]
    assert uptrain_stability.main([*subset, "--summarize"]) == 0
    assert {c["arm"] for c in json.loads((out / "summary.json").read_text())["cells"]} == {"llama"}
    assert uptrain_stability.main([*argv, "--summarize"]) == 0
    assert json.loads((out / "summary.json").read_text())["cells"] == summary["cells"]
    assert {p: p.stat().st_mtime_ns for p in out.glob("runs/*/result.json")} == before  # nothing trained


def test_no_divergence_stop_trains_every_step(source, tmp_path):
    out = tmp_path / "through"
    argv = _argv(source, out, "--arms", "llama", "--learning-rates", "1e-2", "--seeds", "1", "--steps", "6")
    assert uptrain_stability.main([*argv, "--no-divergence-stop"]) == 0
    result = json.loads((out / "runs" / uptrain_stability.run_id("llama", 1e-2, 1) / "result.json").read_text())
    assert result["diverged"] is None and result["rows"][-1]["step"] == 6 and "note" not in result["rows"][-1]
    assert result["final_loss"] == result["rows"][-1]["held_out_loss"]  # the run's own last evaluation, not L0


@pytest.mark.slow  # two tiny heals, like tests/plugin/test_heal.py's
def test_stage_one_heals_sham_heals_and_splits_the_cost(source, tmp_path, capsys):
    out = tmp_path / "split"
    argv = _argv(source, out, "--arms", "healed", "sham_healed", "--learning-rates", "1e-3", "--seeds", "1",
                 "--steps", "2", "--heal-steps", "4", "--heal-eval-steps", "2", "--heal-save-steps", "2")  # fmt: skip
    assert uptrain_stability.main(argv) == 0
    stage1 = json.loads((out / "stage1.json").read_text())
    assert stage1["healed"]["alpha"] == 1.1 and stage1["sham_healed"]["alpha"] == uptrain_stability.SHAM_ALPHA
    assert stage1["sham_healed"]["regime"] == "linear" and stage1["sham_healed"]["phase_p90"][1] < 0.25
    assert stage1["healed"]["phase_p90"][1] > stage1["sham_healed"]["phase_p90"][1]
    assert not any(out.glob("stage1/*/checkpoint-*"))  # heal checkpoints dropped once complete

    results = uptrain_stability.read_results(out, uptrain_stability.parser().parse_args(argv))
    for arm in ("healed", "sham_healed"):  # stage 2 starts from the stage-1 model: its held-out loss at step 0
        assert math.exp(results[(arm, 1e-3, 1)]["initial_loss"]) == pytest.approx(stage1[arm]["perplexity"], rel=1e-4)
    split = json.loads((out / "summary.json").read_text())["split"]
    control = stage1["llama_control"]["perplexity"]
    assert split["sham_over_llama"] == pytest.approx(stage1["sham_healed"]["perplexity"] / control)
    assert split["healed_over_sham"] == pytest.approx(
        stage1["healed"]["perplexity"] / stage1["sham_healed"]["perplexity"]
    )
    table = capsys.readouterr().out
    assert f"| sham heal (alpha 0.05) | {stage1['sham_healed']['perplexity']:.2f} |" in table

    # Stage 1 is cached: a rerun converts and heals nothing again; other heal settings are refused, not mixed in.
    assert uptrain_stability.main(argv) == 0
    assert "stage 1:" not in capsys.readouterr().out
    with pytest.raises(SystemExit, match="stage 1 was built with other settings \\(steps\\)"):
        uptrain_stability.main([*argv, "--heal-steps", "5"])


def test_refusals_are_one_line_naming_the_flag(source, tmp_path, capsys):
    for extra, fragment in ((["--learning-rates", "0"], "--learning-rates [0.0]: every rate must be a positive"),
                            (["--seeds", "1", "1"], "--seeds [1, 1]: repeated value"),
                            (["--steps", "0"], "--steps 0: must be positive")):  # fmt: skip
        with pytest.raises(SystemExit):
            uptrain_stability.main(_argv(source, tmp_path / "x", *extra))
        assert fragment in capsys.readouterr().err
    with pytest.raises(SystemExit):
        uptrain_stability.main(["--source", str(tmp_path), "--output-dir", str(tmp_path / "y")])
    assert f"--source {tmp_path}: no config.json there" in capsys.readouterr().err
