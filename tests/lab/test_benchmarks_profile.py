"""benchmarks/profile_step.py: where a training step's time goes, by group of ops (docs/performance.md)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from attention_overhead import build  # noqa: E402
from profile_step import REST, grouped_self_times  # noqa: E402

FEATURE_MAP = "feature map node (fwd+bwd; inline in the rest without gradients)"
TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
)  # fmt: skip


def test_a_training_step_of_the_compact_layout_books_its_feature_map_node_and_standard_none():
    """The feature map's autograd node (one for queries and keys) and the ops inside it land in its group; standard
    attention has no such node, so a rename of the node would show here as an empty group."""
    ids = torch.randint(0, TINY["vocab_size"], (1, 32), generator=torch.Generator().manual_seed(0))
    compact = grouped_self_times(build("qk_map_compact", "cpu", torch.float32, "sdpa", TINY), ids, None, 1)
    standard = grouped_self_times(build("standard", "cpu", torch.float32, "sdpa", TINY), ids, None, 1)
    assert compact[FEATURE_MAP] > 0 and compact[REST] > 0
    assert standard[FEATURE_MAP] == 0
