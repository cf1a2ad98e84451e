"""``qkmap heal``: take a converted model into the periodic QK-MAP regime, distilling from its source."""

from __future__ import annotations

import argparse
import os

HELP = "Heal a converted QK-MAP checkpoint into the periodic regime (phase schedule + distillation from the source)."


def _fractions(text: str) -> tuple[float, float]:
    start, sep, end = text.partition(":")
    if not sep:
        raise argparse.ArgumentTypeError(f"{text!r}: give START:END as fractions of the run, e.g. 0:0.5")
    return float(start), float(end)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..training.heal import HealOptions
    from ..training.options import add_train_arguments

    parser.add_argument("converted", help="the converted QK-MAP folder (qkmap convert --init exact)")
    parser.set_defaults(model=None)
    add_train_arguments(parser)
    for action in parser._actions:  # the positional CONVERTED takes --model's place
        if action.dest == "model" and action.option_strings:
            action.required, action.help = False, argparse.SUPPRESS
    d = HealOptions(teacher="")
    g = parser.add_argument_group("healing (schedules are fractions of --max-steps, so a short run goes all the way)")
    g.add_argument("--teacher", required=True, help="the source model folder (the converted model's origin)")
    g.add_argument("--alpha", type=float, default=d.alpha, help="target p90 phase per channel, rad")
    g.add_argument(
        "--phase-ramp",
        type=_fractions,
        default=d.phase_ramp,
        metavar="START:END",
        help="window over which omega goes to alpha / p90|z|",
    )
    g.add_argument(
        "--phase-ramp-space",
        choices=("linear", "log"),
        default=d.phase_ramp_space,
        help="linear: phases grow linearly over the window; log: equal time per decade of phase",
    )
    g.add_argument(
        "--compensate-gains",
        action=argparse.BooleanOptionalAction,
        default=d.compensate_gains,
        help="scale each sine gain by its least-squares fit of z as the sine bends (keeps the logit scale)",
    )
    g.add_argument("--layerwise", action="store_true", help="ramp the layers one after another, first to last")
    g.add_argument("--block-spread", type=float, default=d.block_spread, help="phase ratio between frequency blocks")
    g.add_argument(
        "--recalibrate-every",
        type=int,
        default=d.recalibrate_every,
        help="re-measure p90|z| every N steps to hold the phases (0: calibrate once)",
    )
    g.add_argument("--calibration-blocks", type=int, default=d.calibration_blocks)
    g.add_argument(
        "--switch-on-ramp",
        type=_fractions,
        default=d.switch_on_ramp,
        metavar="START:END",
        help="window over which dead (cos, extra-block) key gains ramp to --switch-on-key-gain",
    )
    g.add_argument(
        "--norm-ramp",
        type=_fractions,
        default=d.norm_ramp,
        metavar="START:END",
        help="converted QK-Norm models: window over which the norm power goes 1 -> 0 (folded away at the end)",
    )
    g.add_argument("--switch-on-key-gain", type=float, default=d.switch_on_key_gain,
                   help="key gain of dead sine rows (extra frequency blocks) after switch-on")  # fmt: skip
    g.add_argument("--cos-share", type=float, default=d.cos_share,
                   help="cos rows switched on (both sides) to carry this share of the feature energy; 0: key side "
                   "only, at --switch-on-key-gain")  # fmt: skip
    g.add_argument("--kl-weight", type=float, default=d.kl_weight, help="lambda in CE + lambda * KL(teacher||student)")
    g.add_argument("--kl-weight-end", type=float, help="lambda at the end of the run (linear; default: constant)")
    g.add_argument(
        "--keep-inverse-frequency-gains",
        dest="native_gains",
        action="store_false",
        help="save with inverse-frequency gains instead of the native absolute ones",
    )


def run(args: argparse.Namespace) -> int:
    import qkmap_hf  # noqa: F401  (registers model_type "qkmap" with the Auto classes)

    from ..training.heal import HealOptions, heal
    from ..training.options import TrainOptions

    args.model = args.converted
    heal_options = HealOptions(**{f: getattr(args, f) for f in HealOptions.__dataclass_fields__})
    result = heal(TrainOptions.from_args(args), heal_options)
    if int(os.environ.get("RANK", "0")) == 0:
        loss = result.eval_metrics.get("eval_loss")
        summary = f"saved to {result.output_dir}; rows in heal.json/heal.csv"
        if loss is not None:
            summary += f"; held-out perplexity {result.eval_metrics.get('eval_perplexity', 0):.3f}"
            summary += f", KL to teacher {result.eval_metrics.get('eval_kl_to_teacher', float('nan')):.3e}"
        print(summary)
    return 0
