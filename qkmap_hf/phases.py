"""Phase statistics of QK-MAP layers and the regime they put a model in: the one definition for the whole package.

The phase of a query/key channel is ``omega * z`` (``z`` what the feature map is given: the output of
``q_proj``/``k_proj``, or of the input norm where there is one; query heads use their key head's ``omega``). While it is small, ``(1/omega) sin(omega z) ~ z`` and the layer is standard attention in
disguise (an exact conversion); once the top tenth of ``|omega z|`` reaches 1 rad, large magnitudes sit in the
bounded part of the sine and the layer computes QK-MAP proper. ``qkmap verify``, ``qkmap analyze``, the model card
and ``qkmap heal`` all read these numbers from here:

- per layer: median and p90 of ``|omega z|`` over tokens, query and key heads, frequency blocks and channels
  (``phase_median``/``phase_p90``, query and key values pooled), and the same per role;
- per layer: the cos-block share of feature energy, ``sqrt(share_query * share_key)`` where ``share`` is the
  fraction of ``sum(features**2)`` carried by cos rows on that side. A cos block contributes to the logits only if
  it is on in both queries and keys, so a block switched on in one side only counts as 0;
- the regime: ``linear`` if every layer's p90 is below ``LINEAR_PHASE_P90``, ``periodic`` if every layer's p90 is at
  least ``PERIODIC_PHASE_P90``, ``transitional`` otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

LINEAR_PHASE_P90 = 0.25  # sin(x) is within 1 % of x below this phase: standard attention in disguise
PERIODIC_PHASE_P90 = 1.0  # the top tenth of |z| sits in the bounded part of sin
COS_SHARE_TARGET = 0.1  # issue 10: cos blocks carry at least this share of the feature energy
MAX_SAMPLES = 1_000_000  # torch.quantile's input-size limit; a fixed stride keeps the subsample reproducible
REGIME_DESCRIPTIONS = {
    "linear": "linear (phases small: the layers compute standard attention)",
    "transitional": "transitional (some layers beyond the linear range, not all periodic)",
    "periodic": "periodic (every layer's p90 phase >= 1 rad: magnitude encoded as phase)",
}


def input_dim_of(attention: torch.nn.Module) -> int | None:
    """``m`` of a QK-MAP attention layer: ``QKMapConfig.resolved_qkmap_input_dim`` (for remote code saved before
    that name existed, the layer's ``q_proj`` width per head, which is ``m`` in qk_map mode); None if neither."""
    config = getattr(attention, "config", None)
    return getattr(config, "resolved_qkmap_input_dim", None) or getattr(attention, "projection_dim", None)


def phase_magnitudes(z: torch.Tensor, frequency: torch.Tensor, input_dim: int) -> torch.Tensor:
    """``|omega * z|`` as ``(tokens, kv_heads, groups, F, m)``; ``z`` is ``(..., heads * m)`` from ``q_proj``/``k_proj``
    and ``input_dim`` is ``m`` (``QKMapConfig.resolved_qkmap_input_dim``)."""
    kv_heads, num_freq = frequency.shape[0], frequency.shape[1]
    m = input_dim
    z = z.flatten(-2) if z.dim() == 4 else z  # an input norm's output is (batch, seq, heads, m)
    z = z.detach().float().reshape(-1, z.shape[-1] // m, m)
    z = z.view(z.shape[0], kv_heads, z.shape[1] // kv_heads, 1, m)
    return (z * frequency.detach().float().view(1, kv_heads, 1, num_freq, -1)).abs()


def subsample(values: torch.Tensor, limit: int = MAX_SAMPLES) -> torch.Tensor:
    flat = values.flatten().float()
    return flat[:: math.ceil(flat.numel() / limit)] if flat.numel() > limit else flat


def quantiles(values: torch.Tensor) -> dict[str, float]:
    """Median, mean, p90 and max of a tensor of phases."""
    flat = subsample(values)
    return {
        "median": float(flat.median()),
        "mean": float(flat.mean()),
        "p90": float(torch.quantile(flat, 0.9)),
        "max": float(flat.max()),
    }


def cos_sin_energy(phases: torch.Tensor, effective_gain: torch.Tensor) -> tuple[float, float]:
    """Energy ``sum(features**2)`` of the cos rows and of the sin rows (RoPE rotates within rows: energy kept).

    ``phases``: ``(tokens, kv_heads, groups, F, m)`` signed or absolute (cos is even, sin**2 too);
    ``effective_gain``: ``(kv_heads, 2F, m)`` with rows ``cos_0, sin_0, cos_1, ...``.
    """
    kv_heads, rows, m = effective_gain.shape
    gain = effective_gain.detach().float().view(1, kv_heads, 1, rows // 2, 2, m)
    cos_energy = ((gain[..., 0, :] * phases.cos()) ** 2).sum()
    sin_energy = ((gain[..., 1, :] * phases.sin()) ** 2).sum()
    return float(cos_energy), float(sin_energy)


def cos_share(energy: tuple[float, float]) -> float:
    cos_energy, sin_energy = energy
    total = cos_energy + sin_energy
    return cos_energy / total if total > 0 else 0.0


def layer_label(phase_p90: float) -> str:
    if phase_p90 < LINEAR_PHASE_P90:
        return "linear"
    return "periodic" if phase_p90 >= PERIODIC_PHASE_P90 else "transitional"


def regime(phase_p90_per_layer: list[float]) -> str:
    """``linear``, ``transitional`` or ``periodic`` (see the module docstring) from each layer's p90 phase."""
    labels = {layer_label(p90) for p90 in phase_p90_per_layer}
    if labels == {"linear"}:
        return "linear"
    return "periodic" if labels == {"periodic"} else "transitional"


def regime_from_roles(layers: list[dict[str, Any]]) -> str:
    """The regime from per-role quantiles (``{"query": {"p90"...}, "key": {...}}`` per layer) when the pooled values
    are gone (``qkmap analyze``): the pooled p90 lies between the two role p90s; the larger one stands in for it."""
    return regime([max(layer["query"]["p90"], layer["key"]["p90"]) for layer in layers])


def describe(label: str) -> str:
    return REGIME_DESCRIPTIONS[label]


def feature_map_layers(model: nn.Module) -> list[nn.Module]:
    """Attention modules that own a QK-MAP feature map (``qk_map`` with ``frequency()``), in layer order."""
    return [
        module
        for module in model.modules()
        if callable(getattr(getattr(module, "qk_map", None), "frequency", None)) and hasattr(module, "q_proj")
    ]


def hook_feature_map_inputs(attention: nn.Module, record: Callable[[str, torch.Tensor], None]):
    """Call ``record(role, z)`` with the ``z`` the layer's feature map is given, ``(batch, seq, heads, m)`` for each
    of ``"query"`` and ``"key"`` (after the input norm where there is one); returns the hook handle."""

    def pre_hook(_feature_map: nn.Module, inputs: tuple) -> None:
        for role, z in zip(("query", "key"), inputs[:2], strict=True):
            record(role, z.transpose(1, 2))  # the feature map takes (batch, heads, seq, m)

    return attention.qk_map.register_forward_pre_hook(pre_hook)


class PhaseRecorder:
    """A forward pre-hook on the feature map of every QK-MAP layer; ``summary()`` gives the per-layer statistics.

    The hook sees exactly the ``z`` the feature map is given (after an input norm, where a converted QK-Norm model
    has one). Accumulates over any number of forward passes (an evaluation loop): a strided subsample of the phases
    for the quantiles and exact running sums of cos/sin feature energy. Use as a context manager to remove the hooks.
    """

    def __init__(self, model: nn.Module, samples_per_pass: int = 20_000):
        self.samples_per_pass = samples_per_pass
        self.handles = []
        self.phases: dict[int, dict[str, list[torch.Tensor]]] = {}
        self.energy: dict[int, dict[str, list[float]]] = {}
        for index, attention in enumerate(feature_map_layers(model)):
            layer = int(getattr(attention, "layer_idx", index))
            self.handles.append(hook_feature_map_inputs(attention, self._recorder(layer, attention)))

    def _recorder(self, layer: int, attention: nn.Module) -> Callable[[str, torch.Tensor], None]:
        def record(role: str, z: torch.Tensor) -> None:
            with torch.no_grad():
                feature_map = attention.qk_map
                frequency = feature_map.frequency()
                phases = phase_magnitudes(z, frequency, input_dim_of(attention))
                gain = feature_map.query_gain if role == "query" else feature_map.key_gain
                energy = cos_sin_energy(phases, feature_map.effective_gain(gain, frequency))
                totals = self.energy.setdefault(layer, {}).setdefault(role, [0.0, 0.0])
                totals[0] += energy[0]
                totals[1] += energy[1]
                self.phases.setdefault(layer, {}).setdefault(role, []).append(subsample(phases, self.samples_per_pass))

        return record

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def __enter__(self) -> PhaseRecorder:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def summary(self) -> dict[str, Any] | None:
        """``{"layers": [...], "phase_median": [...], "phase_p90": [...], "cos_energy_share": [...], "regime"}``."""
        if not self.phases:
            return None
        layers = []
        for layer in sorted(self.phases):
            by_role = {role: torch.cat(chunks) for role, chunks in self.phases[layer].items()}
            pooled = quantiles(torch.cat(list(by_role.values())))
            shares = {role: cos_share(tuple(self.energy[layer][role])) for role in by_role}
            entry: dict[str, Any] = {"layer": layer, **{role: quantiles(values) for role, values in by_role.items()}}
            entry["phase_median"], entry["phase_p90"] = pooled["median"], pooled["p90"]
            entry["cos_energy_share"] = math.sqrt(math.prod(shares.values()))
            entry["cos_energy_share_by_role"] = shares
            entry["regime"] = layer_label(pooled["p90"])
            layers.append(entry)
        p90 = [entry["phase_p90"] for entry in layers]
        label = regime(p90)
        return {
            "metric": "|omega * z| over tokens, query and key heads, frequency blocks and channels",
            "layers": layers,
            "phase_median": [entry["phase_median"] for entry in layers],
            "phase_p90": p90,
            "cos_energy_share": [entry["cos_energy_share"] for entry in layers],
            "max_median": max(entry["phase_median"] for entry in layers),
            "regime": label,
            "regime_description": describe(label),
        }


__all__ = [
    "COS_SHARE_TARGET",
    "LINEAR_PHASE_P90",
    "PERIODIC_PHASE_P90",
    "PhaseRecorder",
    "cos_sin_energy",
    "cos_share",
    "describe",
    "feature_map_layers",
    "hook_feature_map_inputs",
    "layer_label",
    "phase_magnitudes",
    "quantiles",
    "regime",
    "regime_from_roles",
]
