"""benchmarks/reshard_sweep.py and ``sweep.reshard``: a sweep's runs laid out over another number of shards."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from qkmap_hf.training.sweep import SWEEP_CSV_FIELDS, reshard, tuning_losses_so_far

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import reshard_sweep  # noqa: E402


def _sweep_folder(folder: Path, rows: list[tuple], timing: dict, diverged: dict | None = None) -> Path:
    folder.mkdir(parents=True)
    lines = [",".join(SWEEP_CSV_FIELDS)] + [",".join(map(str, row)) for row in rows]
    (folder / "sweep_losses.csv").write_text("\n".join(lines) + "\n")
    (folder / "timing.json").write_text(json.dumps(timing))
    if diverged:
        (folder / "diverged.json").write_text(json.dumps(diverged))
    return folder


@pytest.fixture
def sources(tmp_path):
    """A 2-arm shard where arm a's second setting stopped after its first evaluation, and a per-arm folder that
    finished it; arm b has a saved report model."""
    s1, s2 = "learning_rate=0.001", "learning_rate=0.003"
    shard = _sweep_folder(
        tmp_path / "old" / "shard-0",
        [
            ("a", "tune", s1, 1000, 0, "validation", 5.0),
            ("a", "tune", s1, 1000, 100, "validation", 0.75),
            ("a", "tune", s2, 1000, 0, "validation", 5.0),
            ("b", "report", s1, 0, 0, "validation", 5.0),
            ("b", "report", s1, 0, 100, "validation", 0.5),
        ],
        {f"a/tune/{s1}/1000": 11.0, f"a/tune/{s2}/1000": 3.0, f"b/report/{s1}/0": 13.0},
        {f"a/tune/{s1}/1000": {"step": 100, "recorded_loss": 5.0}},
    )
    model = shard / "models" / "b" / "seed0"
    model.mkdir(parents=True)
    (model / "model.safetensors").write_bytes(b"weights of b")
    per_arm = _sweep_folder(
        tmp_path / "old" / "arm-a",
        [("a", "tune", s2, 1000, 0, "validation", 5.0), ("a", "tune", s2, 1000, 100, "validation", 0.25)],
        {f"a/tune/{s2}/1000": 12.0},
    )
    return shard, per_arm


def test_reshard_lays_every_run_out_once_with_its_timing_record_and_model(tmp_path, sources):
    out = tmp_path / "new"
    layout = reshard(list(sources), out, ["a", "b", "c"], 2)

    assert layout == {"shard-0": ["a", "c"], "shard-1": ["b"]}
    # a's second setting comes from the folder that finished it, not the partial copy
    assert tuning_losses_so_far(out / "shard-0") == {
        "a": {"learning_rate=0.001": {"1000": 0.75}, "learning_rate=0.003": {"1000": 0.25}}
    }
    lines = (out / "shard-0" / "sweep_losses.csv").read_text().splitlines()
    assert len(lines) == 1 + 4 and all(line.startswith("a,tune,") for line in lines[1:])
    timing = json.loads((out / "shard-0" / "timing.json").read_text())
    assert timing == {"a/tune/learning_rate=0.001/1000": 11.0, "a/tune/learning_rate=0.003/1000": 12.0}
    assert json.loads((out / "shard-0" / "diverged.json").read_text()) == {
        "a/tune/learning_rate=0.001/1000": {"step": 100, "recorded_loss": 5.0}
    }
    shard1 = out / "shard-1"
    assert (shard1 / "models" / "b" / "seed0" / "model.safetensors").read_bytes() == b"weights of b"
    assert json.loads((shard1 / "timing.json").read_text()) == {"b/report/learning_rate=0.001/0": 13.0}
    assert not (shard1 / "diverged.json").exists()
    assert len((shard1 / "sweep_losses.csv").read_text().splitlines()) == 1 + 2


def test_reshard_refuses_a_used_output_folder_and_arms_it_was_not_given(tmp_path, sources):
    out = tmp_path / "new"
    reshard(list(sources), out, ["a", "b"], 1)
    before = (out / "shard-0" / "sweep_losses.csv").read_text()
    with pytest.raises(ValueError, match="already holds shard-0"):
        reshard(list(sources), out, ["a", "b"], 1)
    assert (out / "shard-0" / "sweep_losses.csv").read_text() == before
    with pytest.raises(ValueError, match=r"\['b'\] are in the sources"):
        reshard(list(sources), tmp_path / "other", ["a"], 1)
    with pytest.raises(ValueError, match="holds no sweep_losses.csv"):
        reshard([tmp_path], tmp_path / "third", ["a"], 1)


def test_the_script_takes_sharded_compare_arm_specs_and_reports_errors_in_one_line(tmp_path, sources, capsys):
    out = tmp_path / "new"
    argv = [str(out), *map(str, sources), "--shards", "2", "--arms", "a:qk_mode=qk_map,qkmap_input_dim=8 b"]
    assert reshard_sweep.main(argv) == 0
    assert capsys.readouterr().out.splitlines() == [f"{out / 'shard-0'}: a", f"{out / 'shard-1'}: b"]
    assert reshard_sweep.main(argv) == 2
    error = capsys.readouterr().err
    assert error.startswith("error: ") and "already holds shard-0, shard-1" in error and error.count("\n") == 1
