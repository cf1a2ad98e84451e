"""What the attention monitor adds to training, measured side by side (qkmap_lab/notes/stability.md, "Monitor overhead").

Runs ``qkmap train`` (the library's ``train``) on a size preset twice per round, interleaved: with the monitor at its
default interval and with ``monitor_steps=0``; reports each round's wall-time ratio and their median. It also times
one probe alone and prints the overhead that implies per training step (probe time / (interval x step time)).

    python benchmarks/monitor_overhead.py --preset claims-cpu --block-size 128 --batch-size 16 --steps 200 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from qkmap_hf.assets import shakespeare_dir
from qkmap_hf.monitoring import DEFAULT_MONITOR_STEPS, probe, probe_batch
from qkmap_hf.training.trainer import TrainOptions, train


def run(options: TrainOptions) -> float:
    started = time.perf_counter()
    train(options, save=False)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="claims-cpu")
    parser.add_argument("--qk-mode", default="qk_map")
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--monitor-steps", type=int, default=DEFAULT_MONITOR_STEPS)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    data = [str(p) for p in sorted(shakespeare_dir().glob("*_gut.txt"))[:6]]
    with tempfile.TemporaryDirectory() as tmp:

        def options(monitor_steps: int, name: str) -> TrainOptions:
            return TrainOptions(
                model=args.preset, data=data, output_dir=str(Path(tmp) / name), qk_mode=args.qk_mode,
                block_size=args.block_size, batch_size=args.batch_size, max_steps=args.steps, save_steps=0,
                eval_fraction=0.0, logging_steps=args.steps, disable_tqdm=True, monitor_steps=monitor_steps,
                max_tokens=args.block_size * args.batch_size * (args.steps + 2),
            )  # fmt: skip

        ratios = []
        for index in range(args.rounds):
            with_monitor = run(options(args.monitor_steps, f"on{index}"))
            without = run(options(0, f"off{index}"))
            ratios.append(with_monitor / without)
            print(f"round {index}: monitor {with_monitor:.2f} s, off {without:.2f} s, ratio {ratios[-1]:.4f}")
        # The probe alone, against the step time of the unmonitored run.
        from qkmap_hf.modeling.modeling_qkmap import QKMapForCausalLM
        from qkmap_hf.training.data import build_datasets, byte_level_tokenizer
        from qkmap_hf.training.presets import preset_config

        tokenizer = byte_level_tokenizer()
        dataset = build_datasets(data, tokenizer, args.block_size, eval_fraction=0.0, max_tokens=args.block_size * 8)[0]
        model = QKMapForCausalLM(preset_config(args.preset, args.qk_mode, vocab_size=len(tokenizer)))
        model.config._attn_implementation = "sdpa"
        ids = probe_batch(dataset)
        probe(model, ids)
        timings = []
        for _ in range(5):
            started = time.perf_counter()
            probe(model, ids)
            timings.append(time.perf_counter() - started)
    step = without / args.steps
    per_step = statistics.median(timings) / (args.monitor_steps * step)
    print(
        f"median run ratio (monitor every {args.monitor_steps} / off): {statistics.median(ratios):.4f} "
        f"(min {min(ratios):.4f}, max {max(ratios):.4f}); one probe {statistics.median(timings) * 1000:.1f} ms, "
        f"step {step * 1000:.1f} ms: {100 * per_step:.2f} % per step at this interval"
    )


if __name__ == "__main__":
    main()
