"""Ops dispatched to decode one token, standard attention against QK-MAP (docs/performance.md, "Decode again").

Counts every aten op a decoding step dispatches (a ``TorchDispatchMode``), for a 2-layer model of one grid shape
(``--head-dim``, ``--heads``, ``--kv-heads``; hidden = heads x head_dim), sdpa, after a 16-token prefill. QK-MAP is
counted as it runs (omega and the gains' rows kept between tokens) and with those rows recomputed every token, as
before they were kept. Prints the totals and the ops whose counts differ. With ``--train``, the ops of one training
step (forward and backward, 16 tokens) of standard attention and both layouts instead, the wide one keeping ``z``
and recomputing the projections (its default): a cost per step and layer that does not shrink with the model ("Is
it the kernel?").

    python benchmarks/decode_op_count.py --head-dim 64 --heads 2 --kv-heads 2
    python benchmarks/decode_op_count.py --head-dim 64 --heads 2 --kv-heads 2 --train
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from qkmap_hf.modeling.configuration_qkmap import QKMapConfig  # noqa: E402
from qkmap_hf.modeling.construction_qkmap import QKMapFeatureMap  # noqa: E402
from qkmap_hf.modeling.modeling_qkmap import QKMapForCausalLM  # noqa: E402


class OpCounter(TorchDispatchMode):
    """Counts aten ops by name."""

    def __init__(self):
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def counted_model(head_dim: int, heads: int, kv_heads: int, layers: int = 2, **fields) -> QKMapForCausalLM:
    """A small model of one grid shape (hidden = heads x head_dim), sdpa; ``fields`` choose the layout."""
    config = QKMapConfig(
        vocab_size=256, hidden_size=heads * head_dim, intermediate_size=352, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, max_position_embeddings=2048,
        attn_implementation="sdpa", **fields,
    )  # fmt: skip
    return QKMapForCausalLM(config)


def decode_ops(head_dim: int, heads: int, kv_heads: int, **fields) -> Counter[str]:
    """The ops of the second decoded token (the first fills what is kept between tokens)."""
    model = counted_model(head_dim, heads, kv_heads, **fields).eval()
    cache = DynamicCache(config=model.config)
    token = torch.tensor([[5]])
    with torch.no_grad():
        model(torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0)), past_key_values=cache)
        model(token, past_key_values=cache)
        with OpCounter() as counter:
            model(token, past_key_values=cache)
    return counter.ops


def training_ops(
    head_dim: int, heads: int, kv_heads: int, layers: int = 2, seq_len: int = 16, **fields
) -> Counter[str]:
    """The ops of one training step (forward, loss, backward) after a first one; their count does not depend on
    ``seq_len``: a per-step cost that a small model pays in full."""
    model = counted_model(head_dim, heads, kv_heads, layers, **fields).train()
    ids = torch.randint(0, 256, (1, seq_len), generator=torch.Generator().manual_seed(0))
    model(ids, labels=ids).loss.backward()
    model.zero_grad(set_to_none=True)
    with OpCounter() as counter:
        model(ids, labels=ids).loss.backward()
    return counter.ops


@contextmanager
def rows_recomputed() -> Iterator[None]:
    """Decoding as before the rows were kept: omega and the gains' rows recomputed every token."""
    kept = QKMapFeatureMap.decoding_parameters

    def recomputed(self, groups):
        self.forget_decoding_parameters()
        return kept(self, groups)

    QKMapFeatureMap.decoding_parameters = recomputed
    try:
        yield
    finally:
        QKMapFeatureMap.decoding_parameters = kept


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--train", action="store_true", help="count one training step's ops instead")
    args = parser.parse_args()
    shape = (args.head_dim, args.heads, args.kv_heads)
    compact = {"qk_mode": "qk_map", "qkmap_input_dim": args.head_dim // 2}
    if args.train:
        wide = {"qk_mode": "qk_map", "qkmap_input_dim": None, "qkmap_recompute_projections": False}  # keeping z
        recomputing = {**wide, "qkmap_recompute_projections": None}  # the wide layout's default
        layouts = (("standard", {"qk_mode": "standard"}), ("compact", compact), ("wide", wide),
                   ("wide, recomputing", recomputing))  # fmt: skip
        counts = {name: training_ops(*shape, **fields) for name, fields in layouts}
    else:
        counts = {"standard": decode_ops(*shape, qk_mode="standard"), "compact": decode_ops(*shape, **compact)}
        with rows_recomputed():
            counts["compact, rows recomputed"] = decode_ops(*shape, **compact)
    print(", ".join(f"{name}: {sum(ops.values())} ops" for name, ops in counts.items()))
    names = sorted(set().union(*counts.values()))
    print(f"{'op':24s}" + "".join(f"{name:>26s}" for name in counts))
    for op in names:
        row = [ops[op] for ops in counts.values()]
        if len(set(row)) > 1:
            print(f"{op:24s}" + "".join(f"{count:26d}" for count in row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
