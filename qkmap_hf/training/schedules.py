"""Schedules that set model state from training progress: the moving parts of ``qkmap heal``.

A schedule is a small object with ``prepare(model)`` (once, before training: remember start values, freeze what it
owns), ``apply(model, progress)`` (``progress`` = finished steps / ``max_steps``, in
[0, 1]) and ``state_dict()``/``load_state_dict()`` for what it measured (so a resumed run continues identically).
``apply`` is a pure function of the progress and that state: calling it at step ``t`` after a resume gives the
model state an uninterrupted run had at step ``t``. New recipes (e.g. annealing a QK-Norm away, issue 11) add a
class with the same three methods.

- ``Ramp``: progress -> strength in [0, 1] over a window of the run (linear or cosine shape).
- ``PhaseScaleSchedule``: frequencies ``omega`` from their converted value to ``alpha / p90|z_c|`` per key head and
  channel, log-linearly or linearly (phases grow linearly); ``calibrate`` measures ``|z_c|`` on fixed blocks (again
  every few steps to hold the phases where the schedule puts them, since shrinking ``W_q``/``W_k`` would otherwise
  bring them back to linear). With ``compensate_gains`` the sine gains follow each channel's least-squares scale
  ``c = E[z s] / E[s^2]``, ``s = sin(omega z) / omega``, so the bent feature keeps the slope of ``z`` it replaces.
- ``GainSwitchOnSchedule``: breaks the zero-gain saddle of an exact conversion: the key gains of rows whose query
  and key gains are both 0 (cos rows, blocks f >= 1) ramp to a small value; the logits do not change (the query
  gain is still 0) but the query gains now receive gradient. With ``cos_share`` the cos rows' query *and* key gains
  ramp to the per-head value at which they carry that share of each side's feature energy (this changes the logits:
  a RoPE-rotated near-constant term, the recency prior of qkmap_lab/notes/paper-claims.md).
- ``NormAnnealSchedule``: a converted QK-Norm model's input norm power ``beta`` from 1 (exact) to 0 (a fixed
  per-channel scale that folds into the projections), with ``r`` calibrated per head on fixed blocks.
- ``ValueSchedule``: a scalar such as the distillation weight lambda.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from ..phases import feature_map_layers, hook_feature_map_inputs, input_dim_of


class Schedule(Protocol):
    name: str

    def prepare(self, model: nn.Module) -> None: ...

    def apply(self, model: nn.Module, progress: float) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class Ramp:
    """Strength 0 before ``start``, 1 after ``end`` (fractions of the run), linear or cosine in between."""

    start: float = 0.0
    end: float = 0.5
    shape: str = "linear"

    def __post_init__(self) -> None:
        if not 0.0 <= self.start <= self.end <= 1.0:
            raise ValueError(
                f"ramp start={self.start}, end={self.end}: need 0 <= start <= end <= 1 (fractions of the run)."
            )
        if self.shape not in ("linear", "cosine"):
            raise ValueError(f"ramp shape {self.shape!r}: choose linear or cosine.")

    def __call__(self, progress: float) -> float:
        if progress >= self.end:
            return 1.0
        if progress <= self.start:
            return 0.0
        t = (progress - self.start) / (self.end - self.start)
        return t if self.shape == "linear" else 0.5 - 0.5 * math.cos(math.pi * t)

    def layer(self, index: int, count: int) -> Ramp:
        """The ramp of layer ``index`` of ``count`` under layer-by-layer progression: its slice of the window."""
        width = (self.end - self.start) / count
        return Ramp(self.start + index * width, self.start + (index + 1) * width, self.shape)


@dataclass
class ValueSchedule:
    """A scalar from ``start`` to ``end`` over ``ramp`` (e.g. the distillation weight)."""

    start: float
    end: float
    ramp: Ramp = Ramp(0.0, 1.0)
    name: str = "value"

    def value(self, progress: float) -> float:
        return self.start + (self.end - self.start) * self.ramp(progress)


def _layer_ramps(ramp: Ramp, count: int, layerwise: bool) -> list[Ramp]:
    return [ramp.layer(i, count) if layerwise else ramp for i in range(count)]


SKETCH_LEVELS = 32  # quantiles of |z| kept per side, key head and channel: E[f(|z|)] ~ mean of f over them


@torch.no_grad()
def channel_magnitudes(model: nn.Module, blocks: torch.Tensor, batch_size: int = 4) -> list[dict[str, torch.Tensor]]:
    """Per QK-MAP layer, ``{"query": |z|, "key": |z|}`` as ``(tokens x group heads, kv_heads, m)`` over ``blocks``
    (``(n, block)`` token ids): what the feature map sees (the input norm's output where there is one)."""
    layers = feature_map_layers(model)
    values: list[dict[str, list[torch.Tensor]]] = [{"query": [], "key": []} for _ in layers]
    handles = []
    for index, attention in enumerate(layers):
        kv_heads, m = attention.qk_map.log_frequency.shape[0], input_dim_of(attention)

        def grab(side: str, z: torch.Tensor, index=index, kv_heads=kv_heads, m=m) -> None:
            z = z.detach().float().reshape(-1, z.shape[-2], m)  # (tokens, heads, m)
            z = z.view(z.shape[0], kv_heads, -1, m).transpose(1, 2).reshape(-1, kv_heads, m)
            values[index][side].append(z.abs())

        handles.append(hook_feature_map_inputs(attention, grab))
    was_training = model.training
    model.eval()
    try:
        device = next(model.parameters()).device
        for start in range(0, len(blocks), batch_size):
            model(input_ids=blocks[start : start + batch_size].to(device), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    return [{side: torch.cat(chunks).cpu() for side, chunks in layer.items()} for layer in values]


def channel_p90(model: nn.Module, blocks: torch.Tensor, batch_size: int = 4) -> list[torch.Tensor]:
    """Per QK-MAP layer, ``p90 |z|`` per key head and channel ``(kv_heads, m)``, pooling the query heads of the group
    and the key head, over ``blocks`` (``(n, block)`` token ids). Shared-frequency layers pool channels later."""
    return [_p90(layer) for layer in channel_magnitudes(model, blocks, batch_size)]


def _p90(layer: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.quantile(torch.cat([layer["query"], layer["key"]]), 0.9, dim=0)


def _sketch(magnitudes: torch.Tensor) -> torch.Tensor:
    """Mid-point quantiles of ``|z|`` per key head and channel: ``(SKETCH_LEVELS, kv_heads, m)``."""
    levels = (torch.arange(SKETCH_LEVELS, dtype=torch.float32) + 0.5) / SKETCH_LEVELS
    return torch.quantile(magnitudes, levels, dim=0)


def least_squares_sine_scale(sketch: torch.Tensor, frequency: torch.Tensor) -> torch.Tensor:
    """Per block and channel, the ``c`` minimising ``E[(c s - z)^2]`` for ``s = sin(omega z) / omega``.

    ``sketch``: ``(levels, kv_heads, m)`` quantiles of ``|z|``; ``frequency``: ``(kv_heads, F, m or 1)``. Returns
    ``(kv_heads, F, m)``; 1 for vanishing phases, growing as the sine bends the largest ``|z|`` down.

    At least 1: where the largest ``|z|`` wrap past pi the fit falls towards 0 (it would switch the channel off, and
    the optimizer's next additive steps would be multiplied back up when the fit recovers); compensation only
    counters the bending.
    """
    z = sketch.unsqueeze(2)  # (levels, kv, 1, m): sin is odd, so |z| gives the same moments as z
    s = torch.sin(frequency * z) / frequency
    return ((z * s).mean(0) / (s * s).mean(0).clamp_min(1e-30)).clamp_min(1.0)


RAMP_SPACES = ("log", "linear")


class PhaseScaleSchedule:
    """``omega`` from its start value to ``alpha * spread**f / p90|z_c|`` over ``ramp``; frequencies frozen.

    Args:
        alpha: target p90 phase of each channel (rad) in block 0; block ``f`` gets ``alpha * block_spread**f``.
        ramp: when the phases grow; ``layerwise`` gives each layer its own slice of the window, first to last.
        space: ``log`` interpolates ``log omega`` (equal time per decade of phase), ``linear`` interpolates
            ``omega`` (phases grow linearly, so most of the window is spent where the sine bends).
        recalibrate_every: re-measure ``|z_c|`` every this many steps on the calibration blocks (0: never), so
            the phases stay at ``alpha`` even if the projections shrink.
        compensate_gains: multiply the sine gains by ``least_squares_sine_scale(omega) / least_squares_sine_scale
            (omega_start)`` per side, key head, block and channel (1 at the start: step 0 stays exact).
    """

    name = "phase_scale"

    def __init__(self, alpha: float = 1.0, ramp: Ramp = Ramp(0.0, 0.5), *, layerwise: bool = False,
                 block_spread: float = 2.0, recalibrate_every: int = 0, space: str = "log",
                 compensate_gains: bool = False):  # fmt: skip
        if alpha <= 0 or block_spread <= 0:
            raise ValueError(f"phase schedule: alpha={alpha} and block_spread={block_spread} must be positive.")
        if space not in RAMP_SPACES:
            raise ValueError(f"phase ramp space {space!r}: choose one of {', '.join(RAMP_SPACES)}.")
        self.alpha, self.ramp, self.layerwise, self.space = alpha, ramp, layerwise, space
        self.block_spread, self.recalibrate_every = block_spread, recalibrate_every
        self.compensate_gains = compensate_gains
        self.start_log_frequency: list[torch.Tensor] = []
        self.p90: list[torch.Tensor] = []
        self.sketch: list[torch.Tensor] = []  # (2 sides, levels, kv_heads, m) quantiles of |z| per layer
        self.applied_scale: list[torch.Tensor] = []  # (2 sides, kv_heads, F, m): compensation now in the gains
        self.calibrated_at = -1

    def prepare(self, model: nn.Module) -> None:
        """Remember the starting frequencies (on a fresh run) and freeze them: the schedule owns them."""
        layers = feature_map_layers(model)
        if not layers:
            raise ValueError(
                "the phase schedule needs a QK-MAP model (qk_mode='qk_map'); convert the checkpoint first."
            )
        if not self.start_log_frequency:
            self.start_log_frequency = [a.qk_map.log_frequency.detach().float().cpu().clone() for a in layers]
        for attention in layers:
            attention.qk_map.log_frequency.requires_grad_(False)

    def calibrate(self, model: nn.Module, blocks: torch.Tensor, step: int) -> None:
        layers = channel_magnitudes(model, blocks)
        self.p90 = [_p90(layer).clamp_min(1e-6) for layer in layers]
        self.sketch = [torch.stack([_sketch(layer["query"]), _sketch(layer["key"])]) for layer in layers]
        self.calibrated_at = step

    def sine_scale(self, index: int, log_frequency: torch.Tensor) -> torch.Tensor:
        """Least-squares scale of each side's sine features at these frequencies relative to the start's."""
        sketch = self.sketch[index]
        start = self.start_log_frequency[index].exp()
        now = log_frequency.float().cpu().exp()
        return torch.stack(
            [least_squares_sine_scale(side, now) / least_squares_sine_scale(side, start) for side in sketch]
        )

    def due(self, step: int) -> bool:
        return not self.p90 or (self.recalibrate_every > 0 and step - self.calibrated_at >= self.recalibrate_every)

    def target_log_frequency(self, index: int, shape: torch.Size) -> torch.Tensor:
        kv_heads, num_freq, width = shape
        p90 = self.p90[index]  # (kv_heads, m)
        if width == 1:  # one frequency per head and block: pool the channels
            p90 = p90.median(dim=-1, keepdim=True).values
        spread = torch.tensor([self.block_spread**f for f in range(num_freq)]).view(1, num_freq, 1)
        return (self.alpha * spread / p90.view(kv_heads, 1, width)).log()

    @torch.no_grad()
    def apply(self, model: nn.Module, progress: float) -> None:
        layers = feature_map_layers(model)
        for index, (attention, ramp) in enumerate(
            zip(layers, _layer_ramps(self.ramp, len(layers), self.layerwise), strict=True)
        ):
            parameter = attention.qk_map.log_frequency
            start = self.start_log_frequency[index]
            strength = ramp(progress)
            if strength == 0.0:
                value = start
            elif self.space == "log":
                value = start + strength * (self.target_log_frequency(index, parameter.shape) - start)
            else:
                target = self.target_log_frequency(index, parameter.shape).exp()
                value = (start.exp() + strength * (target - start.exp())).log()
            parameter.copy_(value.to(parameter.device, parameter.dtype))
            if self.compensate_gains and self.sketch:
                self._compensate(index, attention.qk_map, value)

    def _compensate(self, index: int, feature_map: nn.Module, log_frequency: torch.Tensor) -> None:
        """Move the sine gains from the compensation applied last to the one these frequencies call for."""
        scale = self.sine_scale(index, log_frequency)  # (2, kv, F, m)
        while len(self.applied_scale) <= index:
            self.applied_scale.append(torch.ones_like(scale))
        ratio = scale / self.applied_scale[index]
        for side, gain in enumerate((feature_map.query_gain, feature_map.key_gain)):
            sine_rows = gain[:, 1::2]  # (kv, F, m): row 2f+1 is block f's sine
            sine_rows.mul_(ratio[side].to(gain.device, gain.dtype))
        self.applied_scale[index] = scale

    def state_dict(self) -> dict[str, Any]:
        return {"start_log_frequency": self.start_log_frequency, "p90": self.p90, "sketch": self.sketch,
                "applied_scale": self.applied_scale, "calibrated_at": self.calibrated_at}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.start_log_frequency = list(state["start_log_frequency"])
        self.p90 = list(state["p90"])
        self.sketch = list(state.get("sketch", []))  # absent in state saved before gain compensation
        self.applied_scale = list(state.get("applied_scale", []))
        self.calibrated_at = int(state["calibrated_at"])


class GainSwitchOnSchedule:
    """Key gains of dead rows (query and key gain both exactly 0 at the start) ramp to ``key_gain`` over ``ramp``.

    ``key_gain`` is in stored units (under inverse-frequency gains the converted sine gain is 1). After the ramp the
    optimizer owns these gains; before it they stay exactly 0 and receive exactly zero gradient.

    With ``cos_share > 0`` (and the phase schedule's calibration to read ``|z|`` from) the dead *cos* rows ramp on
    both sides instead: at the ramp's start the schedule computes, per layer, side and key head, the gain at which the
    cos rows carry ``cos_share`` of that side's feature energy at the current phases and gains, and ramps to it;
    the target is measured again after every recalibration of the phase schedule while the window is open.
    """

    name = "gain_switch_on"

    def __init__(self, key_gain: float = 0.1, ramp: Ramp = Ramp(0.4, 0.6), *, layerwise: bool = False,
                 cos_share: float = 0.0, phase: PhaseScaleSchedule | None = None):  # fmt: skip
        if not 0.0 <= cos_share < 1.0:
            raise ValueError(f"switch-on cos_share={cos_share}: a share of the feature energy, in [0, 1).")
        if cos_share and phase is None:
            raise ValueError("switch-on to a cos share needs the phase schedule (its calibration measures |z|).")
        self.key_gain, self.ramp, self.layerwise = key_gain, ramp, layerwise
        self.cos_share, self.phase = cos_share, phase
        self.dead_rows: list[torch.Tensor] = []
        self.cos_targets: list[torch.Tensor] = []  # (2 sides, kv_heads, F, m) stored cos gains at full switch-on
        self.measured_at: list[int] = []  # the phase calibration each layer's target was measured on

    def prepare(self, model: nn.Module) -> None:
        """On a fresh run, find the dead rows ``(kv_heads, 2F)`` of every layer."""
        if not self.dead_rows:
            self.dead_rows = [
                ((a.qk_map.query_gain == 0).all(-1) & (a.qk_map.key_gain == 0).all(-1)).cpu()
                for a in feature_map_layers(model)
            ]

    def _cos_target(self, index: int, feature_map: nn.Module) -> torch.Tensor:
        """Stored cos gains (both sides) that give the cos rows ``cos_share`` of each side's feature energy."""
        omega = feature_map.frequency().detach().cpu()  # (kv, F, w)
        sketch = self.phase.sketch[index]  # (2, levels, kv, m)
        targets = []
        for side, gain in enumerate((feature_map.query_gain, feature_map.key_gain)):
            z = sketch[side].unsqueeze(2)  # (levels, kv, 1, m)
            phase = omega * z
            sine_gain = feature_map.effective_gain(gain.detach().cpu(), omega.cpu())[:, 1::2]  # (kv, F, m)
            sine_energy = (sine_gain * torch.sin(phase)).square().mean(0).sum((-2, -1))  # (kv,)
            cos_energy = torch.cos(phase).square().mean(0).sum((-2, -1))  # per unit gain, (kv,)
            effective = (self.cos_share / (1 - self.cos_share) * sine_energy / cos_energy).sqrt()
            stored = effective.view(-1, 1, 1).expand_as(phase[0]).clone()
            if feature_map.inverse_frequency_gains:
                stored = stored * omega.expand_as(stored)
            targets.append(stored)
        return torch.stack(targets)

    @torch.no_grad()
    def apply(self, model: nn.Module, progress: float) -> None:
        layers = feature_map_layers(model)
        ramps = _layer_ramps(self.ramp, len(layers), self.layerwise)
        for index, (attention, rows, ramp) in enumerate(zip(layers, self.dead_rows, ramps, strict=True)):
            if not rows.any() or progress > ramp.end:
                continue  # after the ramp the optimizer owns the gains
            feature_map, strength = attention.qk_map, ramp(progress)
            if not self.cos_share:
                feature_map.key_gain[rows.to(feature_map.key_gain.device)] = self.key_gain * strength
                continue
            if len(self.cos_targets) < len(layers):
                self.cos_targets = [torch.empty(0) for _ in layers]  # measured per layer while its window is open
                self.measured_at = [-1] * len(layers)
            if strength > 0 and (
                not self.cos_targets[index].numel() or self.phase.calibrated_at > self.measured_at[index]
            ):
                # again after every recalibration: the phases (and the compensated sine gains) still move
                self.cos_targets[index] = self._cos_target(index, feature_map)
                self.measured_at[index] = self.phase.calibrated_at
            cos_rows = rows.clone()
            cos_rows[:, 1::2] = False
            sine_rows = rows & ~cos_rows
            feature_map.key_gain[sine_rows.to(feature_map.key_gain.device)] = self.key_gain * strength
            for side, gain in enumerate((feature_map.query_gain, feature_map.key_gain)):
                value = self.cos_targets[index][side] * strength if strength > 0 else torch.zeros(1)
                rows_of_side = gain[:, 0::2]  # (kv, F, m): row 2f is block f's cos
                mask = cos_rows[:, 0::2].to(gain.device)
                rows_of_side[mask] = value.expand_as(rows_of_side).to(gain.device, gain.dtype)[mask]

    def state_dict(self) -> dict[str, Any]:
        return {"dead_rows": self.dead_rows, "cos_targets": self.cos_targets,
                "measured_at": self.measured_at}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dead_rows = list(state["dead_rows"])
        self.cos_targets = list(state.get("cos_targets", []))
        self.measured_at = [int(step) for step in state.get("measured_at", [])]  # 0-d tensors in older files


class NormAnnealSchedule:
    """Input norm power ``beta = 1 - ramp(progress)`` of a converted QK-Norm model (``qkmap_input_norm``).

    ``calibrate`` (once, on the calibration blocks, at ``beta = 1``) sets each head's ``r`` to its mean ``rms(z)``,
    so the scale of the norm's output stays put as ``beta`` falls. At ``beta = 0`` the norm is ``weight / r`` and
    ``fold_input_norm`` removes it exactly (``qkmap heal`` does so before the final save).
    """

    name = "norm_anneal"

    def __init__(self, ramp: Ramp = Ramp(0.0, 0.8)):
        self.ramp = ramp
        self.reference_scale: list[torch.Tensor] = []

    def _norms(self, model: nn.Module) -> list[nn.Module]:
        return [getattr(a, n) for a in feature_map_layers(model) if hasattr(a, "q_norm") for n in ("q_norm", "k_norm")]

    def prepare(self, model: nn.Module) -> None:
        if not getattr(model.config, "qkmap_input_norm", False):
            raise ValueError(
                "the norm annealing schedule needs a model with an input norm (config.qkmap_input_norm is false); "
                "it is for converted QK-Norm (Qwen3) checkpoints."
            )
        if self.reference_scale:  # resumed: restore the calibrated r
            with torch.no_grad():
                for norm, scale in zip(self._norms(model), self.reference_scale, strict=True):
                    norm.reference_scale.copy_(scale.to(norm.reference_scale.device))

    def due(self, step: int) -> bool:
        return not self.reference_scale

    def calibrate(self, model: nn.Module, blocks: torch.Tensor, step: int, batch_size: int = 4) -> None:
        """Measure ``r`` at ``beta = 1`` (the converted model's own norm), whatever ``beta`` is now."""
        from ..surgery.input_norm import calibrate_reference_scale

        power = model.config.qkmap_input_norm_power
        was_training = model.training
        model.eval()
        try:
            model.config.qkmap_input_norm_power = 1.0
            calibrate_reference_scale(model, (blocks[i : i + batch_size] for i in range(0, len(blocks), batch_size)))
        finally:
            model.config.qkmap_input_norm_power = power
            model.train(was_training)
        self.reference_scale = [norm.reference_scale.detach().float().cpu().clone() for norm in self._norms(model)]

    def power(self, progress: float) -> float:
        return 1.0 - self.ramp(progress)

    def apply(self, model: nn.Module, progress: float) -> None:
        from ..surgery.input_norm import set_input_norm_power

        set_input_norm_power(model, self.power(progress))

    def state_dict(self) -> dict[str, Any]:
        return {"reference_scale": self.reference_scale}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.reference_scale = list(state["reference_scale"])


__all__ = [
    "GainSwitchOnSchedule",
    "NormAnnealSchedule",
    "PhaseScaleSchedule",
    "Ramp",
    "Schedule",
    "ValueSchedule",
    "channel_p90",
]
