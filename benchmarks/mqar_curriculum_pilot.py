"""MQAR sizing pilot outside the harness (qkmap_lab/notes/synthetic-tasks.md, "Third round"): a plain training loop on preset
``tiny`` with the answer-only loss, MQAR sequences and, optionally, dense copying (``copy``) mixed in or first.

AdamW (betas 0.9/0.98) at a constant rate after 200 linear warm-up steps, gradients clipped at 1, one thread. Every
``--eval-every`` steps it appends one JSON line to ``--out``: the last batch's loss, MQAR accuracy and first-answer
accuracy on 512 held-out MQAR sequences, copy accuracy on 256 held-out copy sequences, seconds so far.

    python benchmarks/mqar_curriculum_pilot.py --lr 3e-3 --steps 20000 --copy-mix 0 --out A.jsonl    # MQAR only
    python benchmarks/mqar_curriculum_pilot.py --lr 3e-3 --steps 20000 --copy-mix 0.5 --out B.jsonl  # mixed
    python benchmarks/mqar_curriculum_pilot.py --lr 3e-3 --steps 3000 --eval-every 250 --copy-mix 1 --out C.jsonl
    python benchmarks/mqar_curriculum_pilot.py --lr 3e-3 --steps 3000 --eval-every 250 --copy-mix 1 \
        --copy-until 1000 --out D.jsonl                                                       # copy first, then MQAR
    python benchmarks/mqar_curriculum_pilot.py --mode qk_map --lr 1e-3 --steps 3000 --eval-every 250 --copy-mix 1 \
        --copy-until 1000 --out E.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from qkmap_hf.modeling.modeling_qkmap import QKMapForCausalLM  # noqa: E402
from qkmap_hf.training.presets import preset_config  # noqa: E402
from qkmap_lab.synthetic import IGNORE_INDEX, CopyTask, MQARTask  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", default="standard", help="qk_mode of the model")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--steps", type=int, default=20000)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--queries", type=int, default=8, help="MQAR queries (more than --pairs: with replacement)")
    parser.add_argument("--copy-mix", type=float, default=0.0, help="share of copy sequences in a training batch")
    parser.add_argument("--copy-until", type=int, default=0, help="last step with copy sequences (0: every step)")
    parser.add_argument("--wd", type=float, default=0.0, help="weight decay")
    parser.add_argument("--eval-every", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True, type=Path, help="JSON lines, one per evaluation")
    args = parser.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    config = preset_config("tiny", args.mode, vocab_size=257, max_position_embeddings=args.length)
    model = QKMapForCausalLM(config)
    task = MQARTask(num_pairs=args.pairs, num_queries=args.queries)
    copy = CopyTask()  # 16-token chunks over ids [0, 192): MQAR's filler, keys and values

    def batch(rng: np.random.Generator, count: int, mix: float) -> tuple[torch.Tensor, torch.Tensor]:
        pairs = [
            copy.sequence(rng, args.length) if rng.random() < mix else task.sequence(rng, args.length)
            for _ in range(count)
        ]
        return torch.tensor(np.stack([p[0] for p in pairs])), torch.tensor(np.stack([p[1] for p in pairs]))

    mqar_ids, mqar_labels = batch(np.random.default_rng(10_000 + args.seed), 512, 0.0)
    copy_rng = np.random.default_rng(20_000 + args.seed)
    copies = [copy.sequence(copy_rng, args.length) for _ in range(256)]
    copy_ids, copy_labels = (
        torch.tensor(np.stack([c[0] for c in copies])),
        torch.tensor(np.stack([c[1] for c in copies])),
    )

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.wd, betas=(0.9, 0.98))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 200))

    def accuracy(ids: torch.Tensor, labels: torch.Tensor) -> tuple[float, float]:
        """Argmax accuracy at the labelled positions, and on each sequence's first labelled position."""
        model.eval()
        with torch.no_grad():
            predicted = model(ids).logits.argmax(-1)[:, :-1]
        model.train()
        target = labels[:, 1:]
        labelled = target != IGNORE_INDEX
        right = (predicted == target) & labelled
        first = labelled.float().argmax(1)
        return right.sum().item() / labelled.sum().item(), right[torch.arange(len(target)), first].float().mean().item()

    rng = np.random.default_rng(args.seed)
    start = time.time()
    with args.out.open("w") as log:
        for step in range(1, args.steps + 1):
            mix = args.copy_mix if (args.copy_until == 0 or step <= args.copy_until) else 0.0
            ids, labels = batch(rng, args.batch, mix)
            loss = model(ids, labels=labels).loss
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            if step % args.eval_every == 0 or step == args.steps:
                mqar, first = accuracy(mqar_ids, mqar_labels)
                copied, _ = accuracy(copy_ids, copy_labels)
                record = {"step": step, "loss": round(loss.item(), 4), "mqar": round(mqar, 4), "first": round(first, 4),
                          "copy": round(copied, 4), "s": round(time.time() - start)}  # fmt: skip
                print(json.dumps(record), file=log, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
