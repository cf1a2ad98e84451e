"""Where the time of a training step (or a decoded token) goes: standard against a QK-MAP variant, by kind of op.

Profiles the models of benchmarks/attention_overhead.py with torch.profiler, interleaved (standard, variant,
standard, ...), and prints per-step milliseconds for each group of ops plus everything else. Absolute times
move with machine load; read the groups side by side within one run.

    python benchmarks/profile_step.py --variant qk_map_wide --seq-len 1024 --steps 3 --threads 1
    python benchmarks/profile_step.py --variant qk_map_wide --decode --steps 32
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import profile

sys.path.insert(0, str(Path(__file__).parent))
from attention_overhead import MODEL_SIZE, VARIANTS, build  # noqa: E402

# Self time of ops whose name contains one of these; the first group that matches takes the op.
GROUPS = {
    "attention kernel": ("scaled_dot_product", "aten::bmm", "aten::_softmax"),
    "matmuls (projections, MLP, head)": ("aten::mm", "aten::addmm"),
    # queries and keys go through one QKMapQueryKeyFunction node when both need gradients, else one node each
    "feature map node (fwd+bwd; inline in the rest without gradients)": (
        "QKMapQueryKeyFunction",
        "QKMapFeatureFunction",
    ),
    "value padding": ("aten::constant_pad_nd",),
}
REST = "the rest (RoPE, norms, other elementwise ops, loss, dispatch)"


def group_of(name: str) -> str:
    for group, keys in GROUPS.items():
        if any(key in name for key in keys):
            return group
    return REST


def group_of_event(event) -> str:
    """The outermost group among the op and its callers: ops inside the feature-map node or the padding are theirs."""
    group, parent = REST, event
    while parent is not None:
        group = group_of(parent.name) if group_of(parent.name) != REST else group
        parent = parent.cpu_parent
    return group


def prepare(model, ids: torch.Tensor, decode: bool):
    """For decoding, the prefill (outside the profile): the cache and the first token."""
    if not decode:
        return None
    with torch.no_grad():
        out = model(ids, use_cache=True)
    return [out.cache if hasattr(out, "cache") else out.past_key_values, out.logits[:, -1:].argmax(-1)]


def run(model, ids: torch.Tensor, state, steps: int) -> None:
    if state is None:
        for _ in range(steps):
            model(ids, labels=ids).loss.backward()
            model.zero_grad(set_to_none=True)
        return
    with torch.no_grad():
        for _ in range(steps):
            state[1] = model(state[1], cache=state[0], use_cache=True).logits[:, -1:].argmax(-1)


def grouped_self_times(model, ids: torch.Tensor, state, steps: int) -> dict[str, float]:
    """Profiled self CPU microseconds of ``steps`` steps, summed per group (self times, so nothing counts twice)."""
    totals: dict[str, float] = defaultdict(float)
    with profile() as prof:
        run(model, ids, state, steps)
    for event in prof.events():
        totals[group_of_event(event)] += event.self_cpu_time_total
    return totals


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", default="qk_map_wide", choices=[v for v in VARIANTS if v != "standard"])
    parser.add_argument("--seq-len", type=int, default=1024, help="training length, or the prompt when decoding")
    parser.add_argument("--decode", action="store_true", help="profile decoded tokens after a prefill instead")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds; times are summed over them")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    models = {name: build(name, "cpu", torch.float32, "sdpa") for name in ("standard", args.variant)}
    ids = torch.randint(0, MODEL_SIZE["vocab_size"], (1, args.seq_len))
    totals: dict[str, dict[str, float]] = {name: defaultdict(float) for name in models}
    for model in models.values():  # warm-up
        run(model, ids, prepare(model, ids, args.decode), 1)
    for _ in range(args.rounds):
        for name, model in models.items():
            state = prepare(model, ids, args.decode)
            for group, micros in grouped_self_times(model, ids, state, args.steps).items():
                totals[name][group] += micros
    per_step = args.rounds * args.steps * 1e3
    unit = "ms/token" if args.decode else "ms/step"
    print(
        f"threads={args.threads} {'decode after ' if args.decode else 'train T='}{args.seq_len} steps={args.steps} "
        f"rounds={args.rounds} torch={torch.__version__}"
    )
    print(f"| group ({unit}) | standard | {args.variant} | difference |")
    print("|---|---|---|---|")
    groups = [*GROUPS, REST]
    base_total = sum(totals["standard"].values()) / per_step
    for group in [*groups, "total"]:
        if group == "total":
            a, b = base_total, sum(totals[args.variant].values()) / per_step
        else:
            a, b = totals["standard"][group] / per_step, totals[args.variant][group] / per_step
        print(f"| {group} | {a:.1f} | {b:.1f} | {b - a:+.1f} ({(b - a) / base_total:+.1%} of standard) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
