"""``qkmap demo``: the main job end to end on the embedded default checkpoint (see qkmap_hf/demo.py)."""

from __future__ import annotations

import argparse

HELP = "convert, verify, evaluate, stage and reload the real SmolLM2-135M checkpoint, end to end"


def option_classes() -> tuple[type, ...]:
    from ..demo import DemoOptions

    return (DemoOptions,)


def run(args: argparse.Namespace) -> int:
    from ..demo import DemoOptions, run_demo
    from ..flags import options_from_namespace

    run_demo(options_from_namespace(DemoOptions, args))
    return 0
