"""``qkmap kernels``: build (once per machine) and load the fused CPU kernels, and check them against the eager
map (``qkmap_hf.kernels``)."""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field

HELP = (
    "Build and check the fused CPU kernels, feature map and wide-key attention (once per machine; training and "
    "inference on CPUs then run them)."
)
# The largest relative difference from the eager map the check accepts: float32 rounding of the same math.
CHECK_TOLERANCE = 1e-4


@dataclass
class KernelsArguments:
    """What ``qkmap kernels`` takes."""

    rebuild: bool = field(
        default=False,
        metadata={"help": "build again even where this machine has a build (e.g. after a compiler upgrade)"},
    )


def option_classes() -> tuple[type, ...]:
    return (KernelsArguments,)


def run(args: argparse.Namespace) -> int:
    from ..kernels import (
        KernelBuildError,
        build_fused_kernel,
        check_fused_kernel,
        fused_kernel_loaded,
        kernel_path,
        load_fused_kernel,
    )

    if args.rebuild or not kernel_path().is_file():
        start = time.perf_counter()
        path = build_fused_kernel()  # a KernelBuildError is a refusal of one line, naming the compiler's error
        print(f"built {path} in {time.perf_counter() - start:.1f} s")
        if fused_kernel_loaded():
            print("this process keeps the build it loaded at start; new processes load the new one")
    status = load_fused_kernel()
    if not status.loaded:
        raise KernelBuildError(status.reason)
    print(status.line())
    difference = check_fused_kernel()
    if difference > CHECK_TOLERANCE:
        raise KernelBuildError(
            f"{status.path} disagrees with the eager feature map or sdpa (largest relative difference {difference:.2e}, "
            f"allowed {CHECK_TOLERANCE:.0e}): remove it, run `qkmap kernels --rebuild` and report the compiler"
        )
    print(
        f"check: fused against eager and sdpa, largest relative difference {difference:.1e} (allowed {CHECK_TOLERANCE:.0e})"
    )
    return 0
