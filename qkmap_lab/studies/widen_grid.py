"""A knob's grid of a sharded tuning sweep, widened where any arm's choice lands on its edge.

``python widen_grid.py SWEEP --grid 3e-4,1e-3,... --steps N [--knob learning_rate]`` prints the grid to run next:
the same grid when no arm's lowest tuning loss is at the grid's smallest or largest value of the knob, else the grid
with the next point added on that side (every arm gets the same grid: equal tuning effort). The next point is a
half-decade away for ``learning_rate`` (1, 3, 10, 30 ...) and a factor 2 away for ``logit_scale_multiplier``.
``--around ARM`` prints instead the three half-decade points around ARM's chosen learning rate and its chosen
``logit_scale_multiplier`` (the second size's grid).
"""

from __future__ import annotations

import argparse
import math
import statistics
from pathlib import Path

from qkmap_hf.training.sweep import loss_rank, tuning_losses_so_far

MAX_POINTS = 8


def parse_setting(setting: str) -> dict[str, float]:
    return {name: float(value) for name, value in (part.split("=", 1) for part in setting.split(";"))}


def choices(sweep: Path, steps: int) -> dict[str, dict[str, float]]:
    """Each arm's lowest mean tuning loss setting, over every ``shard-*`` of ``sweep``."""
    losses: dict[str, dict[str, dict[str, float]]] = {}
    for shard in sorted(sweep.glob("shard-*")):
        losses.update(tuning_losses_so_far(shard, steps))
    chosen = {}
    for arm, by_setting in losses.items():
        best = min(by_setting, key=lambda s: loss_rank(statistics.fmean(by_setting[s].values())))
        chosen[arm] = parse_setting(best)
    return chosen


def step_rate(rate: float, half_decades: int) -> float:
    """``rate`` moved by whole half-decades on the 1, 3, 10, 30 ... sequence."""
    position = round(2 * math.log10(rate)) + half_decades
    return float(f"{10 ** (position / 2):.1g}")


def step_factor(value: float, steps: int) -> float:
    """``value`` moved by ``steps`` factors of 2 (the temperature grid's x0.25 ... x4)."""
    return value * 2.0**steps


STEPS = {"learning_rate": step_rate, "logit_scale_multiplier": step_factor}


def widened(grid: list[float], chosen: dict[str, dict[str, float]], knob: str = "learning_rate") -> list[float]:
    values, step = [c[knob] for c in chosen.values()], STEPS[knob]
    grid = sorted(grid)
    if len(grid) >= MAX_POINTS:
        return grid
    if any(math.isclose(v, grid[0]) for v in values):
        grid = [step(grid[0], -1), *grid]
    if any(math.isclose(v, grid[-1]) for v in values) and len(grid) < MAX_POINTS:
        grid = [*grid, step(grid[-1], 1)]
    return grid


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep", type=Path)
    parser.add_argument("--grid", required=True, help="the knob's values run so far, comma-separated")
    parser.add_argument("--knob", default="learning_rate", choices=sorted(STEPS), help="the knob whose grid to widen")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--around", help="print ARM's three-point learning-rate grid and its temperature")
    args = parser.parse_args()
    grid = [float(v) for v in args.grid.split(",")]
    chosen = choices(args.sweep, args.steps)
    if args.around:
        pick = chosen[args.around]
        rate = pick["learning_rate"]
        points = [step_rate(rate, -1), rate, step_rate(rate, 1)]
        print(",".join(f"{p:g}" for p in points), f"{pick['logit_scale_multiplier']:g}")
        return
    print(",".join(f"{p:g}" for p in widened(grid, chosen, args.knob)))


if __name__ == "__main__":
    main()
