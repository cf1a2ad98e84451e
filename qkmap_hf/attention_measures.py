"""Pure measures of causal attention patterns: tensors in, typed results out (no model, no hooks, no files).

Every function takes attention weights shaped ``(batch, heads, queries, keys)`` with query ``t`` at key position
``t`` (a causal self-attention matrix, rows summing to 1 over keys ``<= t``) and reduces them per head. The
callers in ``qkmap_hf/attention_probes.py`` run models and hand the weights here; tests feed hand-built patterns.

- ``attention_distance``: mean ``t - s`` under the attention distribution of query ``t`` (0 = attends to itself),
  and the share of attention mass per distance bucket (for distribution plots).
- ``position_only_share``: how much of the logit variance within each query row is explained by relative
  position alone (an eta-squared over ``t - s``), from log-weights: ``log softmax`` is the logit minus a per-row
  constant, and the per-row constant is removed anyway, since it cannot change the attention.
- ``token_mass_change``: attention mass one key gains when something about it changes (the key-scale probe).
- ``log2_lift``: attention per target token over attention per reference token, per head (evidence contrast).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DISTANCE_BUCKET_EDGES = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


@dataclass(frozen=True)
class PerHead:
    """A per-head measure: ``per_head[h]`` and their mean."""

    per_head: list[float]
    mean: float


@dataclass(frozen=True)
class AttentionDistance:
    """Mean attention distance per head and the attention mass per distance bucket ``[edge_i, edge_i+1)``."""

    per_head: list[float]
    mean: float
    bucket_edges: list[int]
    bucket_mass: list[float]  # mean over heads and queries; sums to 1


def _check(weights: torch.Tensor) -> None:
    if weights.dim() != 4 or weights.shape[-1] != weights.shape[-2]:
        raise ValueError(f"attention weights must be (batch, heads, T, T); got shape {tuple(weights.shape)}.")
    if weights.shape[-1] < 2:
        raise ValueError("attention weights need at least 2 positions (query 0 sees only itself).")


def _distances(length: int, device) -> torch.Tensor:
    positions = torch.arange(length, device=device)
    return (positions[:, None] - positions[None, :]).clamp_min(0)  # (queries, keys), 0 above the diagonal


def attention_distance(weights: torch.Tensor) -> AttentionDistance:
    """Mean ``t - s`` weighted by attention, over queries ``t >= 1`` and the batch, per head."""
    _check(weights)
    weights = weights.double()
    length = weights.shape[-1]
    distance = _distances(length, weights.device).double()
    per_query = (weights * distance).sum(-1)[..., 1:]  # (batch, heads, queries >= 1)
    per_head = per_query.mean(dim=(0, 2))
    edges = [e for e in DISTANCE_BUCKET_EDGES if e < length] + [length]
    masses = []
    for low, high in zip(edges[:-1], edges[1:], strict=True):
        in_bucket = (distance >= low) & (distance < high)
        masses.append(float((weights * in_bucket).sum(-1)[..., 1:].mean()))
    return AttentionDistance(per_head.tolist(), float(per_head.mean()), edges, masses)


def position_only_share(weights: torch.Tensor, iterations: int = 100, tolerance: float = 1e-6) -> PerHead:
    """Share of the within-row logit variance that relative position ``t - s`` explains, per head.

    Logits are recovered as log-weights up to a per-row constant (which cannot change attention). The model
    ``logit[t, s] = a[t] + f(t - s) + residual`` is fitted by least squares (alternating row and distance means,
    pooled over the batch, until ``f`` moves less than ``tolerance``); the share is the fraction of the within-row variance ``f`` removes, adjusted for the
    number of distances fitted (adjusted R^2, so logits unrelated to position measure about 0, not ``K/N``).
    1 means the logit is a function of ``t - s`` alone. Weights that underflowed to 0 are clamped to the smallest
    normal float (such keys carry no attention either way).
    """
    _check(weights)
    batch, heads, length, _ = weights.shape
    causal = torch.ones(length, length, dtype=torch.bool, device=weights.device).tril()
    causal[0] = False  # query 0 has one key: nothing to explain
    mask = causal.double()
    counts = mask.sum(-1).clamp_min(1)  # keys per row
    logits = weights.double().clamp_min(torch.finfo(torch.float32).tiny).log() * mask
    distance = _distances(length, weights.device)
    per_distance = torch.zeros(length, dtype=torch.float64, device=weights.device)
    per_distance.index_add_(0, distance.reshape(-1), mask.reshape(-1))
    per_distance = per_distance * batch

    def row_centered(values: torch.Tensor) -> torch.Tensor:
        return (values - (values * mask).sum(-1, keepdim=True) / counts[:, None]) * mask

    centered = row_centered(logits)
    effect = torch.zeros(heads, length, dtype=torch.float64, device=weights.device)  # f per head and distance
    for _ in range(iterations):
        residual = row_centered(logits - effect[:, distance])  # the best row constants for this f
        sums = torch.zeros(batch, heads, length, dtype=torch.float64, device=weights.device)
        sums.index_add_(2, distance.reshape(-1), (residual * mask).reshape(batch, heads, -1))
        update = sums.sum(0) / per_distance.clamp_min(1)
        effect = effect + update
        if float(update.abs().max()) < tolerance:
            break
    residual = row_centered(logits - effect[:, distance])
    entries, rows, distances = float(per_distance.sum()), batch * (length - 1), length - 1
    within_squares = centered.pow(2).sum(dim=(0, 2, 3))
    within = within_squares / max(1.0, entries - rows)
    unexplained = residual.pow(2).sum(dim=(0, 2, 3)) / max(1.0, entries - rows - distances)
    varies = within_squares > 1e-12 * entries  # below: rounding residue of constant rows, nothing to explain
    share = torch.where(varies, 1 - unexplained / within.clamp_min(1e-300), torch.zeros_like(within))
    return PerHead(share.tolist(), float(share.mean()))


def token_mass_change(base: torch.Tensor, changed: torch.Tensor, token: int, *, absolute: bool = False) -> PerHead:
    """Attention mass key ``token`` gains from the queries after it (``t > token``), mean over them, per head.

    ``absolute=True`` averages the size of the change instead (a key can gain mass from some queries and lose it
    from others; the signed mean would let them cancel).
    """
    _check(base)
    if base.shape != changed.shape:
        raise ValueError(f"attention shapes differ: {tuple(base.shape)} vs {tuple(changed.shape)}.")
    if not 0 <= token < base.shape[-1] - 1:
        raise ValueError(f"token={token} needs a later query; use a position below {base.shape[-1] - 1}.")
    gain = (changed.double() - base.double())[:, :, token + 1 :, token]
    gain = (gain.abs() if absolute else gain).mean(dim=(0, 2))
    return PerHead(gain.tolist(), float(gain.mean()))


def log2_lift(rows: torch.Tensor, target: torch.Tensor, reference: torch.Tensor) -> PerHead:
    """``log2`` of attention per ``target`` token over attention per ``reference`` token, per head: the one formula
    of every contrast (``qkmap analyze``'s needle contrasts, the MQAR evidence contrast).

    ``rows``: ``(heads, keys)`` attention of one query, or ``(heads, queries, keys)`` of several, whose per-row lifts
    are averaged; ``target``/``reference``: boolean masks over keys. 0 means no preference; +1 means a target token
    gets twice a reference token's attention.
    """
    if not target.any() or not reference.any():
        raise ValueError("log2_lift needs at least one target and one reference token.")
    rows = rows.double()
    rows = rows[:, None] if rows.dim() == 2 else rows
    per_target = rows[..., target].sum(-1) / int(target.sum())
    per_reference = rows[..., reference].sum(-1) / int(reference.sum())
    lift = torch.log2(per_target.clamp_min(1e-300) / per_reference.clamp_min(1e-300)).mean(-1)
    return PerHead(lift.tolist(), float(lift.mean()))


__all__ = [
    "DISTANCE_BUCKET_EDGES",
    "AttentionDistance",
    "PerHead",
    "attention_distance",
    "log2_lift",
    "position_only_share",
    "token_mass_change",
]
