"""The paper's four claims measured on a ``qkmap compare --tune --save-models`` run (``benchmarks/paper_claims.sh``).

``qkmap-lab paper-claims SWEEP_DIR`` runs ``qkmap analyze``'s measures on every saved report model
(``SWEEP_DIR/models/ARM/seedS``) and on every arm at initialisation (same config, first report seed), one JSON per
model in ``SWEEP_DIR/diagnostics/`` (finished ones are skipped), then writes ``SWEEP_DIR/claims/claims.json``,
``claims.md`` and plots: per claim a table of arms x metric with the mean over report seeds and paired 95 %
intervals against ``qk_norm`` and ``standard`` (same seeds), and a verdict computed by one stated rule:

- **supported**: ``qk_map``'s paired interval excludes 0 in the claimed direction against both baselines;
- **not supported**: against at least one baseline the interval excludes 0 in the opposite direction;
- **inconclusive**: otherwise (an interval contains 0).

The claim about input scale is about QK-Norm only (it divides scale out); against standard it is reported, not
judged.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qkmap_hf.diagnostics import ModelDiagnostics
from qkmap_hf.fileio import atomic_write_json, atomic_write_text
from qkmap_hf.training.sweep import format_interval, paired_interval

BASELINES = ("qk_norm", "standard")
SUBJECT = "qk_map"
CONTEXT_LENGTHS = (256, 512)
VERDICT_RULE = (
    "supported: qk_map's paired 95 % interval excludes 0 in the claimed direction against every judged baseline; "
    "not supported: against one of them it excludes 0 in the opposite direction; inconclusive: otherwise"
)


@dataclass(frozen=True)
class Metric:
    """One number per model, read from its typed diagnostics, and which direction the paper claims."""

    name: str
    label: str
    extract: Callable[[ModelDiagnostics], float | None]
    claimed_sign: int  # -1: the paper claims qk_map is lower; +1: higher; 0: reported, not judged
    baselines: tuple[str, ...] = BASELINES


def _contrast(kind: str, length: int) -> Callable[[ModelDiagnostics], float | None]:
    def get(d: ModelDiagnostics) -> float | None:
        measured = getattr(d, kind)
        entry = measured.at(length) if measured is not None else None
        return entry.mean_log2_lift if entry else None

    return get


CLAIMS: dict[str, list[Metric]] = {
    "1. lower training and validation loss": [
        Metric("val_loss", "report-split validation loss", lambda d: d.extra.get("val_loss"), -1),
        Metric("train_loss", "train loss, last 20 % of steps", lambda d: d.extra.get("train_loss"), -1),
    ],
    "2. preserves sensitivity to input scale (token-specific)": [
        Metric(
            "key_scale_abs",
            "|attention mass change| of a token whose key is scaled x2",
            lambda d: d.key_scale_sensitivity.mean_abs_change,
            +1,
            ("qk_norm",),
        ),
        Metric(
            "key_scale_gain",
            "signed attention mass gained by that token",
            lambda d: d.key_scale_sensitivity.mean_gain,
            0,
        ),
        Metric(
            "temperature_x2",
            "TV change when all q/k inputs are scaled x2 (temperature test)",
            lambda d: d.scale_sensitivity.mean["2"],
            0,
        ),
    ],
    "3. less attention on the first token": [
        Metric("first_token_mass", "attention mass on token 0", lambda d: d.first_token_mass.mean, -1),
        Metric("attention_distance", "mean attention distance (tokens)", lambda d: d.attention_distance.mean, 0),
        Metric("position_share", "position-only share of logit variance", lambda d: d.position_only_share.mean, 0),
    ],
    "4. stronger attention contrast on relevant evidence": [
        *(
            Metric(
                f"answer_lift_{n}", f"log2 lift answer -> value tokens, {n} tokens", _contrast("answer_contrast", n), +1
            )
            for n in CONTEXT_LENGTHS
        ),
        *(
            Metric(
                f"question_lift_{n}",
                f"log2 lift question -> evidence tokens, {n} tokens",
                _contrast("evidence_contrast", n),
                0,
            )
            for n in CONTEXT_LENGTHS
        ),
    ],
}


# --------------------------------------------------------------------------------------------------
# Diagnostics of every model
# --------------------------------------------------------------------------------------------------


def _settings():
    from qkmap_hf.analysis import AnalysisSettings

    return AnalysisSettings(
        scales=(2.0,), max_tokens=256, num_windows=4, context_lengths=CONTEXT_LENGTHS, needle_examples=4, seed=0
    )


def _init_model(folder: Path, seed: int):
    """The arm's model as its training run started it: same config, same seed (``build_model`` does the same)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, set_seed

    import qkmap_hf  # noqa: F401  (registers model_type "qkmap")

    set_seed(seed)
    config = AutoConfig.from_pretrained(folder)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(folder)


def diagnose(sweep_dir: Path, progress: bool = True) -> dict[str, ModelDiagnostics]:
    """``{"ARM/seedS" or "ARM/init": diagnostics}`` for every saved model; each one computed once, then read back."""
    from qkmap_hf.analysis import analyze_model, load_for_analysis

    summary = json.loads((sweep_dir / "summary.json").read_text())
    out = sweep_dir / "diagnostics"
    out.mkdir(exist_ok=True)
    results: dict[str, ModelDiagnostics] = {}
    for arm, entry in summary["arms"].items():
        seeds = sorted(entry["report_losses"], key=int)
        jobs = [(f"seed{s}", sweep_dir / "models" / arm / f"seed{s}", False) for s in seeds]
        if seeds:
            jobs.append(("init", sweep_dir / "models" / arm / f"seed{seeds[0]}", True))
        for name, folder, at_init in jobs:
            path = out / f"{arm}-{name}.json"
            if not path.exists():
                if not folder.is_dir():
                    continue
                model, tokenizer = _init_model(folder, int(seeds[0])) if at_init else load_for_analysis(folder)
                data = analyze_model(model, tokenizer, settings=_settings(), progress=progress, label=f"{arm}/{name}")
                if not at_init:
                    seed = name.removeprefix("seed")
                    data["val_loss"] = entry["report_losses"][seed]
                    data["train_loss"] = entry["report_train_losses"].get(seed)
                atomic_write_json(path, data)
            results[f"{arm}/{name}"] = ModelDiagnostics.from_dict(json.loads(path.read_text()))
    return results


# --------------------------------------------------------------------------------------------------
# Tables, verdicts, plots
# --------------------------------------------------------------------------------------------------


def metric_table(results: dict[str, ModelDiagnostics], metric: Metric, arms: list[str]) -> dict[str, dict]:
    """Per arm: values per report seed, their mean, and paired differences against each baseline."""
    values: dict[str, dict[str, float]] = {}
    for key, data in results.items():
        arm, name = key.split("/")
        if name.startswith("seed"):
            value = metric.extract(data)
            if value is not None:
                values.setdefault(arm, {})[name] = value
    table = {}
    for arm in arms:
        own = values.get(arm, {})
        row: dict[str, Any] = {"per_seed": own, "mean": statistics.fmean(own.values()) if own else None}
        for baseline in BASELINES:
            other = values.get(baseline, {})
            seeds = [s for s in own if s in other]
            if arm != baseline and seeds:
                row[f"vs_{baseline}"] = paired_interval([own[s] - other[s] for s in seeds])
        table[arm] = row
    return table


def verdict(table: dict[str, dict], metric: Metric) -> str:
    """``qk_map`` against every one of ``metric.baselines``, each by ``verdicts.rule`` (the one rule): not supported
    where one says so, supported where all do, else inconclusive."""
    from qkmap_lab.verdicts import BETTER, rule

    if metric.claimed_sign == 0:
        return "reported, not judged"
    row = table.get(SUBJECT, {})
    intervals = [row.get(f"vs_{b}") for b in metric.baselines]
    if any(i is None or i["low"] is None for i in intervals):
        return "inconclusive (too few paired seeds)"
    each = [rule([i["low"], i["high"]], BETTER[metric.claimed_sign]) for i in intervals]
    if "not supported" in each:
        return "not supported"
    return "supported" if all(v == "supported" for v in each) else "inconclusive"


def _cell(entry: dict | None) -> str:
    return format_interval(entry, spec=".4g", single="")


def claims_markdown(
    tables: dict[str, dict[str, dict]], verdicts: dict[str, str], at_init: dict[str, ModelDiagnostics]
) -> str:
    lines = []
    for claim, metrics in CLAIMS.items():
        lines += [f"### Claim {claim}", ""]
        for metric in metrics:
            table = tables[metric.name]
            lines += [
                f"**{metric.label}** (`{metric.name}`): verdict for qk_map: **{verdicts[metric.name]}**",
                "",
                "| arm | mean | seeds | vs qk_norm | vs standard |",
                "|---|---|---|---|---|",
            ]
            for arm, row in table.items():
                mean = f"{row['mean']:.4g}" if row["mean"] is not None else ""
                lines.append(
                    f"| {arm} | {mean} | {len(row['per_seed'])} | {_cell(row.get('vs_qk_norm'))} "
                    f"| {_cell(row.get('vs_standard'))} |"
                )
            lines.append("")
    lines += [
        "### At initialisation (first report seed, untrained)",
        "",
        "| arm | first-token mass | attention distance | position-only share | key-scale abs change |",
        "|---|---|---|---|---|",
    ]
    for arm, data in at_init.items():
        lines.append(
            f"| {arm} | {data.first_token_mass.mean:.4g} | {data.attention_distance.mean:.4g} "
            f"| {data.position_only_share.mean:.4g} | {data.key_scale_sensitivity.mean_abs_change:.4g} |"
        )
    return "\n".join(lines) + "\n"


def _figure(width: float = 7.0, height: float = 4.5):
    from qkmap_hf.plotting import new_figure

    figure = new_figure(width, height)
    return figure, figure.add_subplot()


def _save(figure, path: Path) -> None:
    from qkmap_hf.plotting import save_figure

    figure.tight_layout()
    save_figure(figure, path, tight=False)


def _layer_mean(rows: list[list[float]]) -> list[float]:
    """Mean over layers of per-layer lists of equal length."""
    return [statistics.fmean(column) for column in zip(*rows, strict=True)]


def plot_claims(
    results: dict[str, ModelDiagnostics], tables: dict[str, dict], arms: list[str], folder: Path
) -> list[Path]:
    """Final validation loss per arm (seeds as dots), attention distance distribution, first-token mass per layer."""
    paths = []
    figure, axis = _figure()
    for x, arm in enumerate(arms):
        row = tables["val_loss"].get(arm, {})
        seeds = list(row.get("per_seed", {}).values())
        axis.scatter([x] * len(seeds), seeds, color="C0", s=14)
        if seeds:
            axis.hlines(statistics.fmean(seeds), x - 0.3, x + 0.3, color="C3")
    axis.set_xticks(range(len(arms)), arms, rotation=35, ha="right", fontsize=8)
    axis.set_ylabel("report-split validation loss (nats/token)")
    axis.set_title("final validation loss per arm at its tuned setting (dots: report seeds, bar: mean)")
    axis.grid(alpha=0.3)
    paths.append(folder / "validation_loss_per_arm.png")
    _save(figure, paths[-1])

    for kind, title, path_name in (
        ("trained", "attention mass by distance t - s (trained, mean over report seeds)", "attention_distance.png"),
        ("init", "attention mass by distance t - s (at initialisation)", "attention_distance_init.png"),
    ):
        figure, axis = _figure()
        for n, arm in enumerate(arms):
            runs = [
                d for k, d in results.items() if k.split("/")[0] == arm and (k.endswith("/init") == (kind == "init"))
            ]
            if not runs:
                continue
            per_model = [_layer_mean(r.attention_distance.bucket_mass) for r in runs]
            buckets = [statistics.fmean(m[i] for m in per_model) for i in range(len(per_model[0]))]
            edges = runs[0].attention_distance.bucket_edges
            axis.plot(
                range(len(buckets)),
                buckets,
                marker="o",
                label=arm,
                color=f"C{n % 10}",
                linestyle="-" if n < 10 else "--",
            )
        axis.set_xticks(
            range(len(edges) - 1),
            [f"{a}-{b - 1}" if b - a > 1 else f"{a}" for a, b in zip(edges[:-1], edges[1:], strict=True)],
            rotation=35,
            fontsize=7,
        )
        axis.set_xlabel("distance t - s (tokens)")
        axis.set_ylabel("attention mass (mean over queries, heads, layers)")
        axis.set_title(title, fontsize=10)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7)
        paths.append(folder / path_name)
        _save(figure, paths[-1])

    figure, axis = _figure()
    for n, arm in enumerate(arms):
        runs = [d for k, d in results.items() if k.split("/")[0] == arm and k.split("/")[1].startswith("seed")]
        if runs:
            layers = len(runs[0].first_token_mass.layer_mean)
            means = [statistics.fmean(r.first_token_mass.layer_mean[i] for r in runs) for i in range(layers)]
            axis.plot(range(layers), means, marker="o", label=arm, color=f"C{n % 10}")
    axis.set_xlabel("layer")
    axis.set_ylabel("attention mass on token 0")
    axis.set_title("first-token mass per layer (trained, mean over report seeds)")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=7)
    paths.append(folder / "first_token_mass_per_layer.png")
    _save(figure, paths[-1])
    return paths


def write_claims(sweep_dir: str | Path, progress: bool = True) -> dict:
    """Diagnose every model, then write ``claims/claims.json``, ``claims.md`` and the plots; returns the JSON."""
    sweep_dir = Path(sweep_dir)
    results = diagnose(sweep_dir, progress)
    arms = list(json.loads((sweep_dir / "summary.json").read_text())["arms"])
    folder = sweep_dir / "claims"
    folder.mkdir(exist_ok=True)
    metrics = [m for ms in CLAIMS.values() for m in ms]
    tables = {m.name: metric_table(results, m, arms) for m in metrics}
    verdicts = {m.name: verdict(tables[m.name], m) for m in metrics}
    at_init = {k.split("/")[0]: d for k, d in results.items() if k.endswith("/init")}
    plots = plot_claims(results, tables, arms, folder)
    data = {"rule": VERDICT_RULE, "tables": tables, "verdicts": verdicts, "plots": [p.name for p in plots]}
    atomic_write_json(folder / "claims.json", data)
    atomic_write_text(folder / "claims.md", claims_markdown(tables, verdicts, at_init))
    return data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="qkmap-lab paper-claims", description=__doc__.splitlines()[0])
    parser.add_argument("sweep_dir", help="output folder of `qkmap compare --tune --save-models`")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    write_claims(args.sweep_dir, progress=not args.no_progress)
    print((Path(args.sweep_dir) / "claims" / "claims.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
