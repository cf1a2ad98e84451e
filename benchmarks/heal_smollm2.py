"""Healing measured on SmolLM2-135M-Instruct: converted (exact) -> ``qkmap heal`` vs the Llama model up-trained on the
same tokens with the same optimizer. Resumable: a finished arm is skipped, an interrupted heal arm resumes.

    OMP_NUM_THREADS=1 python benchmarks/heal_smollm2.py --output-dir runs/heal2d --steps 200 --batch-size 1 \
        --eval-steps 25 --save-steps 50 --alpha 1.1 --qkmap-learning-rate 5e-3 --switch-on-key-gain 0.3 \
        --arms heal-klend=0-cos=0.12                  # the defaults (docs/healing.md, recipe 2)

Arms (``--arms``): ``heal`` (``--alpha``, ``--kl-weight``; variants such as ``heal-alpha=0.6``, ``heal-kl=0``, keys in
``VARIANT_KEYS``) and
``llama`` (``qkmap train`` of the source). Writes ``summary.json`` (settings, data, per-arm final numbers, attention behaviour of the source and
the healed model), each arm's ``heal.json``/``heal.csv`` rows, and ``heal_trajectory.png``.
``--plot-only`` redraws the plot from the files.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

import qkmap_hf
from qkmap_hf.assets import shakespeare_files, shakespeare_text, smollm2_hf_dir
from qkmap_hf.fileio import atomic_write_json
from qkmap_hf.training.data import build_datasets
from qkmap_hf.training.heal import HealOptions, heal
from qkmap_hf.training.trainer import TrainOptions, load_tokenizer, train

BEHAVIOUR_PLAY = "tempest_gut"  # attention statistics on the play qkmap verify uses (part of the training text)


@torch.no_grad()
def attention_behaviour(model_dir: str, tokenizer, tokens: int = 256, windows: int = 2) -> dict:
    """First-token attention mass and mean attention distance (tokens), averaged over layers, heads, queries >= 1."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    ids = tokenizer(shakespeare_text(max_chars=40_000, plays=(BEHAVIOUR_PLAY,)), add_special_tokens=False).input_ids
    masses, distances = [], []
    for w in range(windows):
        window = torch.tensor([ids[w * tokens : (w + 1) * tokens]])
        attentions = model(input_ids=window, output_attentions=True, use_cache=False).attentions
        offsets = (torch.arange(tokens)[:, None] - torch.arange(tokens)[None, :]).clamp_min(0).float()
        masses.append([float(a[0, :, 1:, 0].mean()) for a in attentions])
        distances.append([float((a[0, :, 1:] * offsets[1:]).sum(-1).mean()) for a in attentions])
    per_layer_mass = [sum(v) / windows for v in zip(*masses, strict=True)]
    per_layer_distance = [sum(v) / windows for v in zip(*distances, strict=True)]
    return {
        "first_token_mass": sum(per_layer_mass) / len(per_layer_mass),
        "mean_attention_distance": sum(per_layer_distance) / len(per_layer_distance),
        "first_token_mass_per_layer": per_layer_mass,
        "mean_attention_distance_per_layer": per_layer_distance,
        "tokens": tokens,
        "windows": windows,
        "text": BEHAVIOUR_PLAY,
    }


@torch.no_grad()
def split_perplexity(model, blocks: torch.Tensor, batch_size: int = 8) -> float:
    """Perplexity over ``blocks`` (every block weighs the same, as the Trainer's evaluation)."""
    losses = []
    for start in range(0, len(blocks), batch_size):
        batch = blocks[start : start + batch_size]
        losses.append(float(model(input_ids=batch, labels=batch).loss) * len(batch))
    return math.exp(sum(losses) / len(blocks))


@torch.no_grad()
def folder_perplexity(folder: Path, blocks: torch.Tensor) -> float:
    from transformers import AutoModelForCausalLM

    return split_perplexity(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval(), blocks)


def tuning_blocks(tokenizer, block_size: int, max_blocks: int) -> torch.Tensor:
    """The tuning split: blocks of the Milton files, which neither training nor the held-out split contains."""
    _, tuning_set, _ = build_datasets(
        shakespeare_files(milton=True), tokenizer, block_size, max_eval_blocks=max_blocks, max_tokens=100_000
    )
    return tuning_set.blocks


@torch.no_grad()
def forcing_sweep(converted: Path, calibration: torch.Tensor, splits: dict[str, torch.Tensor], alphas: list[float],
                  recipe: str = "plain") -> list[dict]:  # fmt: skip
    """The cost of forcing the periodic regime before any training: the heal schedules at their end point
    (``omega = alpha / p90|z_c|``, calibrated on the first training blocks as in a heal), perplexity per split.

    ``recipe``: ``plain`` (frequencies only), ``compensated`` (+ least-squares sine gains), ``cos`` (+ cos rows
    switched on to a 10 % energy share: the whole default recipe).
    """
    from transformers import AutoModelForCausalLM

    from qkmap_hf.phases import PhaseRecorder
    from qkmap_hf.training.schedules import GainSwitchOnSchedule, PhaseScaleSchedule, Ramp

    rows = []
    for alpha in alphas:
        model = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()
        phase = PhaseScaleSchedule(alpha, Ramp(0.0, 0.0), compensate_gains=recipe != "plain")
        switch = GainSwitchOnSchedule(ramp=Ramp(0.0, 0.0), cos_share=0.1 if recipe == "cos" else 0.0, phase=phase)
        for schedule in (phase, switch):
            schedule.prepare(model)
        phase.calibrate(model, calibration, step=0)
        phase.apply(model, 1.0)
        if recipe == "cos":
            phase.calibrate(model, calibration, step=1)  # |z| at the forced phases, as a heal measures it
            switch.apply(model, 0.0)
        row = {"alpha": alpha, "recipe": recipe}
        for name, blocks in splits.items():
            with PhaseRecorder(model) as recorder:
                row[f"{name}_perplexity"] = split_perplexity(model, blocks)
            if name == "held_out":
                phases = recorder.summary()
                row |= {"perplexity": row["held_out_perplexity"], "regime": phases["regime"],
                        "phase_median": phases["phase_median"], "phase_p90": phases["phase_p90"],
                        "cos_energy_share": phases["cos_energy_share"]}  # fmt: skip
        rows.append(row)
        print("forcing", {k: v for k, v in row.items() if not isinstance(v, list)}, flush=True)
    return rows


def plot(out: Path, summary: dict) -> None:
    from matplotlib.figure import Figure

    figure = Figure(figsize=(12, 4.2))
    ax_ppl, ax_phase, ax_front = figure.subplots(1, 3)
    llama = summary["arms"].get("llama", {})
    for arm, record in summary["arms"].items():
        rows = record.get("evaluations")
        if not rows:
            if arm == "llama":
                steps = [r["step"] for r in record.get("curve", [])]
                ax_ppl.plot(
                    steps, [r["perplexity"] for r in record.get("curve", [])], "k--", label="llama (up-trained)"
                )
            continue
        steps = [r["step"] for r in rows]
        (line,) = ax_ppl.plot(steps, [r["perplexity"] for r in rows], marker="o", label=arm)
        color = line.get_color()  # one colour per arm in every panel
        ax_phase.plot(steps, [min(r["phase_p90"]) for r in rows], marker="o", color=color, label=f"{arm}: min p90")
        ax_phase.plot(steps, [min(r["cos_energy_share"]) for r in rows], ls=":", color=color,
                      label=f"{arm}: min cos energy share")  # fmt: skip
        ratio = [r["perplexity"] / llama["final_perplexity"] for r in rows] if llama.get("final_perplexity") else None
        if ratio:
            ax_front.plot([min(r["phase_p90"]) for r in rows], ratio, marker="o", color=color,
                          label=f"{arm} (/ final Llama arm)")  # fmt: skip
    forcing = summary.get("forcing") or []
    for recipe, style in (("plain", "s--"), ("compensated", "^--"), ("cos", "v--")):
        rows = [r for r in forcing if r.get("recipe", "plain") == recipe]
        if rows and llama.get("start_perplexity"):
            ax_front.plot([min(r["phase_p90"]) for r in rows], [r["perplexity"] / llama["start_perplexity"] for r in rows],
                          style, color="grey", alpha=0.9, label=f"forced, {recipe}, no training (/ source)")  # fmt: skip
    ax_ppl.set(xlabel="optimizer step", ylabel="held-out perplexity", title="perplexity", yscale="log")
    ax_phase.axhline(1.0, color="grey", lw=0.8)
    ax_phase.axhline(0.1, color="grey", lw=0.8, ls=":")
    ax_phase.set(xlabel="optimizer step", ylabel="rad / share", title="phase p90 and cos share (min over layers)")
    ax_front.axhline(1.05, color="grey", lw=0.8)
    ax_front.set(xlabel="min over layers of p90 phase (rad)", ylabel="perplexity ratio (see legend)",
                 title="phase vs perplexity", yscale="log")  # fmt: skip
    for axis in (ax_ppl, ax_phase, ax_front):
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7)
    figure.suptitle("SmolLM2-135M: healing a converted model into the periodic regime")
    figure.tight_layout()
    figure.savefig(out / "heal_trajectory.png", dpi=110)


def markdown(summary: dict) -> str:
    """The tables of docs/healing.md, from summary.json."""
    arms, lines = summary["arms"], []
    llama = arms.get("llama", {})
    lines += ["| arm | step | held-out perplexity | / Llama arm (final) | KL to teacher | regime | min p90 phase | "
              "min cos share |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for arm, record in arms.items():
        for row in record.get("evaluations", []):
            ratio = row["perplexity"] / llama["final_perplexity"] if llama.get("final_perplexity") else float("nan")
            lines.append(f"| {arm} | {row['step']} | {row['perplexity']:.2f} | {ratio:.3f} | {row['kl_to_teacher']:.3g} | "
                         f"{row['regime']} | {min(row['phase_p90']):.3g} | {min(row['cos_energy_share']):.3g} |")  # fmt: skip
        for point in record.get("curve", []):
            lines.append(f"| {arm} | {point['step']} | {point['perplexity']:.2f} | "
                         f"{point['perplexity'] / llama['final_perplexity']:.3f} | | standard attention | | |")  # fmt: skip
    for arm, record in arms.items():
        rows = record.get("evaluations")
        if not rows:
            continue
        last = rows[-1]
        lines += ["", f"Per layer at step {last['step']} ({arm}):", "",
                  "| layer | median phase | p90 phase | cos energy share |", "|---|---|---|---|"]  # fmt: skip
        for i, (median, p90, share) in enumerate(
            zip(last["phase_median"], last["phase_p90"], last["cos_energy_share"], strict=True)
        ):
            lines.append(f"| {i} | {median:.3g} | {p90:.3g} | {share:.3g} |")
    behaviours = {"source": summary.get("source_behaviour")} | {
        arm: r["behaviour"] for arm, r in arms.items() if r.get("behaviour")
    }
    if any(behaviours.values()):
        lines += ["", "| model | first-token mass | mean attention distance (tokens) |", "|---|---|---|"]
        for name, b in behaviours.items():
            if b:
                lines.append(f"| {name} | {b['first_token_mass']:.4f} | {b['mean_attention_distance']:.2f} |")
    if summary.get("forcing"):
        lines += ["", "| recipe | alpha (forced, no training) | held-out perplexity | tuning (Milton) perplexity | "
                  "min p90 phase | max p90 phase | min cos share | regime |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for row in summary["forcing"]:
            tuning = row.get("tuning_milton_perplexity")
            if row.get("recipe") == "none":
                lines.append(
                    f"| none (converted, unforced) | 0 | {row['held_out_perplexity']:.2f} | {tuning:.2f} | | | | linear |"
                )
                continue
            cos = min(row["cos_energy_share"]) if row.get("cos_energy_share") else 0.0
            lines.append(f"| {row.get('recipe', 'plain')} | {row['alpha']} | {row['perplexity']:.2f} | "
                         f"{'' if tuning is None else f'{tuning:.2f}'} | {min(row['phase_p90']):.3g} | "
                         f"{max(row['phase_p90']):.3g} | {cos:.3g} | {row['regime']} |")  # fmt: skip
    return "\n".join(lines)


VARIANT_KEYS = {"alpha": ("alpha", float), "kl": ("kl_weight", float), "klend": ("kl_weight_end", float),
                "cos": ("cos_share", float), "comp": ("compensate_gains", lambda v: v == "1"),
                "space": ("phase_ramp_space", str)}  # fmt: skip


def heal_options_for(arm: str, args: argparse.Namespace, teacher: str) -> HealOptions:
    """``heal`` with the command's settings, or a variant such as ``heal-alpha=0.6-kl=0`` (keys: VARIANT_KEYS)."""
    given = {"alpha": args.alpha, "kl_weight": args.kl_weight, "switch_on_key_gain": args.switch_on_key_gain,
             "cos_share": args.cos_share}  # fmt: skip
    values = {name: value for name, value in given.items() if value is not None}  # None: HealOptions' default
    for part in arm.split("-")[1:]:
        key, _, text = part.partition("=")
        if key not in VARIANT_KEYS:
            raise SystemExit(f"arm {arm!r}: unknown variant key {key!r}; known: {', '.join(VARIANT_KEYS)}")
        name, parse = VARIANT_KEYS[key]
        values[name] = parse(text)
    return HealOptions(teacher=teacher, **values)


def arm_options(model: str | Path, files: list[str], arm_dir: Path, args: argparse.Namespace) -> TrainOptions:
    """The training settings every arm shares (heal and Llama arm alike), resuming from ``arm_dir``'s newest
    checkpoint; benchmarks/uptrain_stability.py heals with them too, so both measure the same heal."""
    return TrainOptions(
        model=str(model), data=files, output_dir=str(arm_dir), block_size=args.block_size,
        batch_size=args.batch_size, eval_batch_size=8, learning_rate=args.learning_rate,
        qkmap_learning_rate=args.qkmap_learning_rate, max_steps=args.steps, eval_steps=args.eval_steps,
        logging_steps=5, save_steps=args.save_steps, save_total_limit=1, warmup=0.05, weight_decay=0.0,
        max_eval_blocks=args.max_eval_blocks, resume="latest" if any(arm_dir.glob("checkpoint-*")) else None,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", default="runs/heal-smollm2")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--learning-rate", type=float, default=5e-5)
    parser.add_argument("--qkmap-learning-rate", type=float, default=5e-3)
    parser.add_argument("--alpha", type=float, help="default: HealOptions' default")
    parser.add_argument("--kl-weight", type=float, help="default: HealOptions' default")
    parser.add_argument("--switch-on-key-gain", type=float, help="default: HealOptions' default")
    parser.add_argument("--cos-share", type=float, help="default: HealOptions' default")
    parser.add_argument("--eval-steps", type=int, default=25)
    parser.add_argument("--save-steps", type=int, default=50)
    parser.add_argument("--max-eval-blocks", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=400_000)
    parser.add_argument("--arms", nargs="+", default=["heal", "llama"],
                        help="heal, llama, or heal variants such as heal-alpha=0.6, heal-kl=0, heal-alpha=0.6-kl=0")  # fmt: skip
    parser.add_argument("--behaviour", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--forcing-alphas", nargs="*", type=float, default=[],
                        help="also measure the untrained cost of forcing these alphas (after the arms)")  # fmt: skip
    parser.add_argument("--forcing-recipes", nargs="+", default=["plain"], choices=("plain", "compensated", "cos"),
                        help="which schedules the forcing sweep applies (see forcing_sweep)")  # fmt: skip
    parser.add_argument("--plot-only", action="store_true")
    parser.add_argument("--markdown", action="store_true", help="print the docs tables from summary.json")
    args = parser.parse_args(argv)

    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary_path = out / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {"arms": {}}
    if args.plot_only or args.markdown:
        plot(out, summary)
        if args.markdown:
            print(markdown(summary))
        return 0
    source = smollm2_hf_dir()
    converted = out / "smollm2-qkmap-exact"
    if not (converted / "config.json").exists():
        qkmap_hf.convert_checkpoint(source, converted, init="exact", progress=False)
    files = shakespeare_files()
    tokenizer = load_tokenizer(TrainOptions(model=str(source), data=files, output_dir=str(out)))
    datasets = build_datasets(
        files, tokenizer, args.block_size, max_eval_blocks=args.max_eval_blocks, max_tokens=args.max_tokens
    )
    summary["settings"] = vars(args) | {
        "command": "python benchmarks/heal_smollm2.py " + " ".join(argv or sys.argv[1:])
    }
    summary["data"] = datasets[2].to_dict() | {"sources": len(files)}
    if args.behaviour and "source_behaviour" not in summary:
        summary["source_behaviour"] = attention_behaviour(str(source), tokenizer)
        atomic_write_json(summary_path, summary)

    for arm in args.arms:
        record = summary["arms"].get(arm, {})
        final_checkpoint = out / arm / f"checkpoint-{args.steps}"  # the Llama arm keeps only its checkpoints
        if record.get("done") and args.behaviour and "behaviour" not in record and final_checkpoint.is_dir():
            record["behaviour"] = attention_behaviour(str(final_checkpoint), tokenizer)
            atomic_write_json(summary_path, summary)
        if record.get("done") and arm != "llama" and "tuning_milton_perplexity" not in record:
            # the final model on the tuning split, which chooses between recipes
            record["tuning_milton_perplexity"] = folder_perplexity(
                out / arm, tuning_blocks(tokenizer, args.block_size, 24)
            )
            atomic_write_json(summary_path, summary)
        if record.get("done"):
            print(f"{arm}: done already, skipped", flush=True)
            continue
        started = time.time()
        arm_dir = out / arm
        options = arm_options(source if arm == "llama" else converted, files, arm_dir, args)
        if arm == "llama":
            result = train(options, datasets=datasets, tokenizer=tokenizer, save=False)
            curve = [
                {"step": h["step"], "perplexity": math.exp(h["eval_loss"])}
                for h in result.log_history
                if "eval_loss" in h
            ]
            record = {
                "curve": curve,
                "final_perplexity": curve[-1]["perplexity"],
                "start_perplexity": curve[0]["perplexity"],
            }
            if args.behaviour and (arm_dir / f"checkpoint-{args.steps}").is_dir():
                record["behaviour"] = attention_behaviour(str(arm_dir / f"checkpoint-{args.steps}"), tokenizer)
        else:
            heal_options = heal_options_for(arm, args, str(source))
            alpha, kl_weight = heal_options.alpha, heal_options.kl_weight
            result = heal(options, heal_options, datasets=datasets, tokenizer=tokenizer)
            rows = json.loads((arm_dir / "heal.json").read_text())["evaluations"]
            record = {"recipe": asdict(heal_options), "evaluations": rows, "final_perplexity": rows[-1]["perplexity"], "alpha": alpha, "kl_weight": kl_weight,
                      "final_kl_to_teacher": rows[-1]["kl_to_teacher"], "regime": rows[-1]["regime"]}  # fmt: skip
            if args.behaviour:
                record["behaviour"] = attention_behaviour(str(arm_dir), tokenizer)
        record |= {"done": True, "seconds": time.time() - started, "train_seconds": result.wall_seconds}

        summary["arms"][arm] = record
        atomic_write_json(summary_path, summary)
        if arm != "llama":
            record["tuning_milton_perplexity"] = folder_perplexity(
                arm_dir, tuning_blocks(tokenizer, args.block_size, 24)
            )
            atomic_write_json(summary_path, summary)
        print(arm, {k: v for k, v in record.items() if k not in ("evaluations", "curve", "behaviour")}, flush=True)
        plot(out, summary)
    if args.forcing_alphas:
        train_set, eval_set, _ = datasets
        splits = {"held_out": eval_set.blocks, "tuning_milton": tuning_blocks(tokenizer, args.block_size, 24)}
        if not any(r.get("recipe") == "none" for r in summary.get("forcing", [])):  # the unforced reference
            reference = {f"{name}_perplexity": folder_perplexity(converted, blocks) for name, blocks in splits.items()}
            summary.setdefault("forcing", []).insert(0, {"alpha": 0.0, "recipe": "none", **reference})
        for recipe in args.forcing_recipes:
            rows = forcing_sweep(converted, train_set.blocks[:8], splits, args.forcing_alphas, recipe)
            replaced = {(recipe, alpha) for alpha in args.forcing_alphas}
            kept = [r for r in summary.get("forcing", []) if (r.get("recipe", "plain"), r["alpha"]) not in replaced]
            summary["forcing"] = kept + rows
            atomic_write_json(summary_path, summary)
        atomic_write_json(summary_path, summary)
        plot(out, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
