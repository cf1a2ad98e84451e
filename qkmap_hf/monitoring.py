"""A training monitor for attention-logit growth and divergence, kept on by default (qkmap_lab/notes/stability.md).

QK-Norm exists to stop attention logits from growing until softmax is one-hot (Wortsman et al. 2023, "Small-scale
proxies for large-scale Transformer training instabilities"); QK-MAP claims to bound them without normalizing. The
monitor measures that during training on any causal LM whose attention goes through transformers' attention
interface (a plain Llama as well as QK-MAP): every ``every_steps`` optimizer steps, and at the first and the last,
it runs one forward pass on a fixed probe batch and logs through ``Trainer.log`` (so TensorBoard, W&B, trackio and
``trainer_state.json`` keep it, and a resumed run continues the same log), per layer and the worst over layers:

- ``max_logit``: the largest pre-softmax attention logit (scale included, masked entries left out);
- ``entropy_mean`` / ``entropy_min``: attention entropy in nats, mean over query rows, then mean and min over heads
  (rows with a single visible key, whose entropy is 0 by construction, are left out);
- ``max_probability``: each row's largest attention probability, averaged over rows, for the most peaked head;
- ``logit_bound``: what bounds ``|logit|``: for ``qk_map`` ``scale * sqrt(sum max(a_cos^2, a_sin^2))`` over the query
  gains times the same over the key gains (Cauchy-Schwarz on the features; the worst key/value head), for
  ``qk_norm`` ``scale * head_dim * max|w_q| * max|w_k|`` from the norm weights, for ``standard`` the probe's
  ``scale * max||q|| * max||k||`` (a bound that the data sets, not the parameters);
- ``query_norm_max`` / ``key_norm_max``: the largest query and key vector norm reaching the kernel (all modes),
  ``query_gain_norm`` / ``key_gain_norm`` (qk_map; Frobenius norm of the effective gains, worst head) or
  ``q_norm_weight_max`` / ``k_norm_weight_max`` (qk_norm);
- qk_map only: ``frequency_min`` / ``frequency_max`` (omega) and ``key_phase_p90`` (p90 of ``|omega z|`` over keys,
  measured by ``phases.PhaseRecorder``, the one phase recorder);
- for the model: ``log_partition_mean`` / ``log_partition_max``, the output logits' ``logsumexp`` (the symptom
  that z-loss treats).

``DivergenceGuard`` stops a run whose logged training loss is not finite, or stays above the loss it started from
(``L0``, the first logged loss) for ``patience`` logs after the warm-up, and records why in ``state``.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import TrainerCallback

from .modeling.construction_qkmap import qkmap_gain_bound
from .modeling.qk_registry import constructions_for
from .modeling.query_key import QueryKeyRMSNorm

MONITOR_PREFIX = "monitor/"
MONITOR_ATTENTION = "qkmap_monitor"
DEFAULT_MONITOR_STEPS = 50
PROBE_SEQUENCES = 4
# Worst over layers: the largest of these, the smallest of the rest.
LARGER_IS_WORSE = (
    "max_logit",
    "max_probability",
    "logit_bound",
    "query_norm_max",
    "key_norm_max",
    "query_gain_norm",
    "key_gain_norm",
    "q_norm_weight_max",
    "k_norm_weight_max",
    "frequency_max",
    "key_phase_p90",
)
SMALLER_IS_WORSE = ("entropy_mean", "entropy_min", "frequency_min")


# --------------------------------------------------------------------------------------------------
# Measures
# --------------------------------------------------------------------------------------------------


def masked_logits(
    query: torch.Tensor, key: torch.Tensor, scaling: float, attention_mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pre-softmax logits ``(batch, heads, T, S)`` in float32 and the mask of visible keys (True: attended).

    ``query`` ``(batch, heads, T, D)`` and ``key`` ``(batch, kv_heads, S, D)`` as they reach the kernel (GQA groups
    share their key head); ``attention_mask`` is transformers' 4-D mask (boolean: True keeps; float: added), or None
    for plain causal attention with the queries at the last ``T`` of ``S`` positions.
    """
    batch, heads, length, _ = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    grouped = query.float().reshape(batch, kv_heads, heads // kv_heads, length, -1)
    logits = torch.matmul(grouped, key.float().unsqueeze(2).transpose(-1, -2)).mul_(scaling)
    logits = logits.reshape(batch, heads, length, keys)
    if attention_mask is None:
        visible = torch.ones(length, keys, dtype=torch.bool, device=query.device).tril(keys - length)
    elif attention_mask.dtype == torch.bool:
        visible = attention_mask[..., :keys]
    else:
        visible = attention_mask[..., :keys] > torch.finfo(attention_mask.dtype).min / 2
    return logits, visible.expand(batch, heads, length, keys)


def attention_statistics(logits: torch.Tensor, visible: torch.Tensor) -> dict[str, float]:
    """Largest logit, entropy (mean and min over heads) and peak probability of one layer (see module docstring)."""
    log_probs = logits.masked_fill(~visible, float("-inf")).log_softmax(dim=-1)
    probs = log_probs.exp()
    entropy = -(probs * log_probs.masked_fill(~visible, 0.0)).sum(-1)  # (batch, heads, T)
    weight = (visible.sum(-1) > 1).float()  # one visible key: entropy 0 and probability 1 by construction
    count = weight.sum(dim=(0, 2)).clamp_min(1.0)
    entropy_per_head = (entropy * weight).sum(dim=(0, 2)) / count
    peak_per_head = (probs.amax(-1) * weight).sum(dim=(0, 2)) / count
    return {
        "max_logit": float(logits.masked_fill(~visible, float("-inf")).amax()),
        "entropy_mean": float(entropy_per_head.mean()),
        "entropy_min": float(entropy_per_head.min()),
        "max_probability": float(peak_per_head.max()),
    }


def parameter_statistics(attention: nn.Module, scaling: float) -> dict[str, float]:
    """The parameter side of one layer (the logit bound its parameters imply, gain or norm-weight sizes, omega), as
    its query/key constructions report it. An attention of another family with per-head norms (a Qwen3) is read as
    QK-Norm."""
    config = getattr(attention, "config", None)
    statistics: dict[str, float] = {}
    for construction in constructions_for(config) if config is not None else ():
        statistics.update(construction.statistics(attention, scaling))
    norms = [getattr(getattr(attention, name, None), "weight", None) for name in QueryKeyRMSNorm.modules]
    if not statistics and all(isinstance(weight, torch.Tensor) for weight in norms):
        statistics = QueryKeyRMSNorm.statistics(attention, scaling)
    return statistics


@dataclass
class ProbeRecord:
    """What one probe pass measured: per layer (in layer order) and for the whole model."""

    layers: list[dict[str, float]] = field(default_factory=list)
    model: dict[str, float] = field(default_factory=dict)

    def worst(self) -> dict[str, float]:
        """Each per-layer measure at its worst layer (largest or smallest, see the module constants)."""
        worst: dict[str, float] = {}
        for name in {k for layer in self.layers for k in layer}:
            values = [layer[name] for layer in self.layers if name in layer]
            worst[name] = min(values) if name in SMALLER_IS_WORSE else max(values)
        return worst

    def flat(self) -> dict[str, float]:
        """``monitor/NAME`` (worst over layers, and the model's) and ``monitor/layerI/NAME`` for ``Trainer.log``."""
        logs = {f"{MONITOR_PREFIX}{k}": v for k, v in {**self.worst(), **self.model}.items()}
        for index, layer in enumerate(self.layers):
            logs.update({f"{MONITOR_PREFIX}layer{index}/{k}": v for k, v in layer.items()})
        return logs


def _register_monitor_attention(recorded: dict[int, dict[str, float]]) -> None:
    """Register ``MONITOR_ATTENTION``: eager attention that records ``attention_statistics`` per layer."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask

    def monitored_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        logits, visible = masked_logits(query, key, scale, attention_mask)
        stats = attention_statistics(logits, visible)
        stats["query_norm_max"] = float(query.float().norm(dim=-1).amax())
        stats["key_norm_max"] = float(key.float().norm(dim=-1).amax())
        stats.update(parameter_statistics(module, scale))
        stats.setdefault("logit_bound", scale * stats["query_norm_max"] * stats["key_norm_max"])  # standard
        recorded[int(getattr(module, "layer_idx", len(recorded)))] = stats
        probs = logits.masked_fill(~visible, float("-inf")).softmax(dim=-1).to(value.dtype)
        output = torch.matmul(probs, value.repeat_interleave(query.shape[1] // value.shape[1], dim=1))
        return output.transpose(1, 2).contiguous(), None

    AttentionInterface.register(MONITOR_ATTENTION, monitored_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(MONITOR_ATTENTION, eager_mask)


@torch.no_grad()
def probe(model: nn.Module, input_ids: torch.Tensor) -> ProbeRecord:
    """One forward pass of ``model`` on ``input_ids`` with every attention layer measured (the model is left as it
    was: training mode and attention implementation restored)."""
    from .diagnostics.phases import from_recorder
    from .phases import PhaseRecorder

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = base.config
    recorded: dict[int, dict[str, float]] = {}
    _register_monitor_attention(recorded)
    previous, was_training = config._attn_implementation, base.training
    config._attn_implementation = MONITOR_ATTENTION
    base.eval()
    try:
        device = next(base.parameters()).device
        with PhaseRecorder(base) as phases:
            output = base(input_ids=input_ids.to(device), use_cache=False)
        phase = from_recorder(phases)
    finally:
        config._attn_implementation = previous
        base.train(was_training)
    layers = [recorded[i] for i in sorted(recorded)]
    if phase is not None:
        for layer, entry in zip(layers, phase.layers, strict=False):
            layer["key_phase_p90"] = entry.key.p90
    log_partition = output.logits.float().logsumexp(dim=-1)
    return ProbeRecord(
        layers, {"log_partition_mean": float(log_partition.mean()), "log_partition_max": float(log_partition.max())}
    )


# --------------------------------------------------------------------------------------------------
# Callbacks
# --------------------------------------------------------------------------------------------------


def probe_batch(dataset, sequences: int = PROBE_SEQUENCES) -> torch.Tensor | None:
    """The first ``sequences`` blocks of a packed dataset (held-out preferred by the caller) as one batch."""
    if dataset is None or len(dataset) == 0:
        return None
    rows = [torch.as_tensor(dataset[i]["input_ids"]) for i in range(min(sequences, len(dataset)))]
    return torch.stack(rows)


class TrainingMonitor(TrainerCallback):
    """Logs ``probe(model, probe_ids)`` through ``Trainer.log`` every ``every_steps`` steps, at the first and last.

    Attach with ``TrainingMonitor.attach(trainer, probe_ids)``: the callback needs the trainer to log through it.
    """

    def __init__(self, probe_ids: torch.Tensor, every_steps: int = DEFAULT_MONITOR_STEPS):
        if every_steps <= 0:
            raise ValueError(f"monitor every_steps={every_steps} must be positive (0 turns the monitor off).")
        self.probe_ids = probe_ids
        self.every_steps = every_steps
        self.trainer = None

    @classmethod
    def attach(cls, trainer, probe_ids: torch.Tensor, every_steps: int = DEFAULT_MONITOR_STEPS) -> TrainingMonitor:
        monitor = cls(probe_ids, every_steps)
        monitor.trainer = trainer
        trainer.add_callback(monitor)
        return monitor

    def _due(self, state) -> bool:
        step = state.global_step
        return step == 1 or step % self.every_steps == 0 or step == state.max_steps

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if self.trainer is None or not self._due(state) or not state.is_world_process_zero:
            return control
        logged = {entry.get("step") for entry in state.log_history if f"{MONITOR_PREFIX}max_logit" in entry}
        if state.global_step in logged:  # a resumed run re-entering a step it already measured
            return control
        record = probe(model if model is not None else self.trainer.model, self.probe_ids)
        due_to_log = control.should_log  # Trainer.log resets it, which would drop this step's loss log
        self.trainer.log(record.flat())
        control.should_log = due_to_log
        return control


class DivergenceGuard(TrainerCallback):
    """Stops a run whose loss is not finite or stays above ``L0``; ``diverged`` then says why and where.

    A non-finite training loss stops the run at once. "Stays above ``L0``" is judged on the held-out loss when the
    run evaluates before its first step (``eval_on_start``): ``L0`` is that evaluation and ``eval_patience``
    consecutive evaluations above it after the warm-up stop the run. One training batch is a noisy draw (a pretrained
    model up-trained with batch 1 logs losses above its own average half the time), so the training loss is the
    criterion only for runs that do not evaluate: ``L0`` is then the first logged loss (``logging_first_step``) and
    ``patience`` consecutive logs above it stop the run. Needs ``logging_nan_inf_filter=False``, or the Trainer hides
    non-finite losses from the log.
    """

    def __init__(self, patience: int = 3, eval_patience: int = 2):
        self.patience = patience
        self.eval_patience = eval_patience
        self.initial_loss: float | None = None
        self.judged_on: str | None = None  # "eval_loss" or "loss": set by the first log that carries one
        self.above = 0
        self.diverged: dict[str, Any] | None = None

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        loss = logs.get("loss")
        if self.judged_on is None and ("eval_loss" in logs or loss is not None):
            self.judged_on = "eval_loss" if "eval_loss" in logs and state.global_step == 0 else "loss"
        reason = None
        if loss is not None and not math.isfinite(loss):
            reason = f"loss {loss} at step {state.global_step}"
        judged = logs.get(self.judged_on) if self.judged_on else None
        if judged is not None and reason is None:
            if self.initial_loss is None:
                self.initial_loss = float(judged)
            warmup_over = state.global_step > max(args.get_warmup_steps(state.max_steps), 1)
            self.above = self.above + 1 if warmup_over and not judged <= self.initial_loss else 0
            patience = self.eval_patience if self.judged_on == "eval_loss" else self.patience
            if self.above >= patience:
                what = "held-out loss" if self.judged_on == "eval_loss" else "loss"
                reason = f"{what} above L0={self.initial_loss:.4f} for {self.above} logs (step {state.global_step})"
        if reason and self.diverged is None:
            self.diverged = {"reason": reason, "step": state.global_step, "initial_loss": self.initial_loss}
            control.should_training_stop = True
        return control


# --------------------------------------------------------------------------------------------------
# Reading and plotting
# --------------------------------------------------------------------------------------------------


def monitor_series(log_history: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """``{name: [(step, value), ...]}`` of every ``monitor/...`` key in a Trainer log history (prefix removed)."""
    series: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for entry in log_history:
        for key, value in entry.items():
            if key.startswith(MONITOR_PREFIX):
                series[key[len(MONITOR_PREFIX) :]].append((int(entry["step"]), float(value)))
    return dict(series)


PLOT_PANELS = (
    ("max_logit", "max attention logit"),
    ("entropy_mean", "attention entropy, mean over heads (nats)"),
    ("max_probability", "peak attention probability"),
    ("logit_bound", "logit bound from the parameters"),
    ("log_partition_max", "output logsumexp (max over tokens)"),
)


def plot_monitor(log_history: list[dict], path: Path, title: str = "training monitor") -> Path | None:
    """The monitor's measures against step, one line per layer, one panel per measure; None when nothing logged."""
    from .plotting import new_figure, save_figure

    series = monitor_series(log_history)
    panels = [(name, label) for name, label in PLOT_PANELS if name in series]
    if not panels:
        return None
    figure = new_figure(4.2 * len(panels), 3.4)
    for index, (name, label) in enumerate(panels, start=1):
        axis = figure.add_subplot(1, len(panels), index)
        layers = sorted(
            {k.split("/")[0] for k in series if k.startswith("layer") and k.endswith(f"/{name}")},
            key=lambda s: int(s[5:]),
        )
        for layer in layers:
            steps, values = zip(*series[f"{layer}/{name}"], strict=True)
            axis.plot(steps, values, label=layer, linewidth=1.2)
        if not layers:
            steps, values = zip(*series[name], strict=True)
            axis.plot(steps, values, label="model", linewidth=1.2)
        axis.set_title(label, fontsize=9)
        axis.set_xlabel("optimizer step")
        axis.grid(alpha=0.3)
        if index == 1:
            axis.legend(fontsize=7)
    figure.suptitle(title)
    save_figure(figure, path, dpi=110)
    return path


__all__ = [
    "DEFAULT_MONITOR_STEPS",
    "DivergenceGuard",
    "ProbeRecord",
    "TrainingMonitor",
    "attention_statistics",
    "masked_logits",
    "monitor_series",
    "plot_monitor",
    "probe",
    "probe_batch",
    "qkmap_gain_bound",
]
