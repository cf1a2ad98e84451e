"""The long study's grid rule: a knob's grid grows on the side where any arm's choice sits on its edge, by the
knob's own step, for every arm alike."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

STUDIES = Path(__file__).resolve().parents[2] / "qkmap_lab" / "studies"


@pytest.fixture(scope="module")
def widen_grid():
    spec = importlib.util.spec_from_file_location("widen_grid", STUDIES / "widen_grid.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_learning_rate_on_an_edge_adds_the_next_half_decade_there(widen_grid):
    grid = [3e-4, 1e-3, 3e-3, 1e-2]
    inside = {"standard": {"learning_rate": 3e-3}, "qk_map": {"learning_rate": 1e-3}}
    assert widen_grid.widened(grid, inside) == grid
    on_top = {"standard": {"learning_rate": 1e-2}, "qk_map": {"learning_rate": 1e-3}}
    assert widen_grid.widened(grid, on_top) == [*grid, 0.03]
    both = {"standard": {"learning_rate": 1e-2}, "qk_map": {"learning_rate": 3e-4}}
    assert widen_grid.widened(grid, both) == [1e-4, *grid, 0.03]


def test_a_temperature_on_an_edge_adds_a_factor_of_two_there(widen_grid):
    grid = [0.25, 0.5, 1.0, 2.0, 4.0]
    low = {"qk_norm": {"logit_scale_multiplier": 0.25}, "standard": {"logit_scale_multiplier": 0.5}}
    assert widen_grid.widened(grid, low, "logit_scale_multiplier") == [0.125, *grid]
    high = {"qk_norm": {"logit_scale_multiplier": 4.0}}
    assert widen_grid.widened(grid, high, "logit_scale_multiplier") == [*grid, 8.0]


def test_a_grid_at_its_size_limit_stays(widen_grid):
    grid = [10.0**e for e in range(-8, 0)]
    assert len(grid) == widen_grid.MAX_POINTS
    assert widen_grid.widened(grid, {"a": {"learning_rate": grid[0]}}) == grid


@pytest.mark.slow
def test_the_gpu_scale_comparison_runs_at_tiny_size_on_a_cpu(tmp_path):
    """The device's comparison, smoke-tested: the same command, three arms, one seed each, a summary per arm."""
    import csv
    import math
    import os
    import subprocess

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        ["bash", str(STUDIES / "gpu_scale_compare.sh"), str(tmp_path), "--cpu-smoke"],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    with (tmp_path / "summary.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert [row["mode"] for row in rows] == ["standard", "qk_norm", "qk_map"]
    assert all(
        math.isfinite(float(row["val_loss_mean"])) and float(row["val_loss_mean"]) < 5.6 for row in rows
    )  # < ln 257
